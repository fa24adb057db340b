#!/usr/bin/env python3
"""Multiple-choice accuracy of the Monte-Carlo ELBO log-likelihood (dlm_engine.integrations.likelihood) on the embedded
tiny model, against the number of samples, with and without the EOS-padded answer layout.

    python experiments/eval_likelihood.py [--n 200] [--samples 1,4,16,64] [--batch 64]

Each held-out add/sub prompt (``tasks.held_out``, a seed never used in training) gets four choices: the
answer and three distractors that change one digit. Printed per setting: accuracy, the spread of the
estimate of the correct choice over 8 independent seeds (mean standard deviation), the ELBO of the correct
choice, and the time per scored choice.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from dlm_engine.app import tasks  # noqa: E402
from dlm_engine.app.api import load_directory  # noqa: E402
from dlm_engine.integrations.likelihood import mc_loglikelihood  # noqa: E402


def distractors(answer: str, rng: random.Random, k: int = 3):
    out = set()
    while len(out) < k:
        i = rng.randrange(len(answer))
        d = rng.choice([c for c in "0123456789" if c != answer[i]])
        out.add(answer[:i] + d + answer[i + 1:])
    return sorted(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--samples", default="1,4,16,64")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seeds", type=int, default=8, help="independent estimates for the spread")
    args = ap.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    lm = load_directory()
    rng = random.Random(0)
    examples = tasks.held_out(args.n, tasks=("add", "sub"))
    items = [(lm.encode(e.prompt), [e.answer] + distractors(e.answer, rng)) for e in examples]
    gen = 16
    print(f"{len(items)} prompts x 4 choices (answer first), embedded tiny model, CPU {torch.get_num_threads()} threads")
    print("| layout | mc_samples | accuracy | sd of the estimate | ELBO of the answer | ms / choice |")
    print("|---|---|---|---|---|---|")
    for pad in (True, False):
        for s in [int(x) for x in args.samples.split(",")]:
            correct, sds, gold, t0, scored = 0, [], [], time.perf_counter(), 0
            g = torch.Generator().manual_seed(0)
            for ctx, choices in items:
                targets = [lm.encode(c) + ([lm.eos_id] * (gen - len(c)) if pad else []) for c in choices]
                scores = [mc_loglikelihood(lm, ctx, t, s, args.batch, g) for t in targets]
                scored += len(targets)
                correct += int(max(range(len(scores)), key=scores.__getitem__) == 0)
                gold.append(scores[0])
            elapsed = time.perf_counter() - t0
            for ctx, choices in items[:20]:  # spread: independent estimates of the answer's ELBO
                t = lm.encode(choices[0]) + ([lm.eos_id] * (gen - len(choices[0])) if pad else [])
                vals = [mc_loglikelihood(lm, ctx, t, s, args.batch, torch.Generator().manual_seed(100 + k))
                        for k in range(args.seeds)]
                sds.append(statistics.pstdev(vals))
            layout = "answer + EOS to 16" if pad else "answer only"
            print(f"| {layout} | {s} | {correct / len(items):.3f} | {statistics.mean(sds):.3f} | "
                  f"{statistics.mean(gold):.3f} | {1000 * elapsed / scored:.2f} |", flush=True)


if __name__ == "__main__":
    main()
