#!/usr/bin/env python3
"""The floor under issue 17's item 1: a framework-free decode loop next to dlm_engine's, same model, same tokens.

Two strategies are written out here as the bare loops their references run -- Fast-dLLM's threshold rule and
LLaDA's low-confidence remasking (temperature 0, no cache, batch 1, one block after another) -- with nothing the
framework adds: no FrameDelta, no per-position step record, no finished flags, no first-forward health check, no
caches, rows or EOS options, no strategy object. Each calls the model exactly as the step loop does (the window's
logits only), so the model's CPU is the same work, and each must make the very tokens dlm_engine makes (checked,
every prompt). The CPU outside the model, over decode CPU, is then measured with ``bench_overhead.py``'s protocol
(one torch thread, thread CPU, the smallest of ``--repeats`` runs) for both, and the tensor operations a step
outside the model are counted the same way for both (``SyncCounter``, one more run each).

    python experiments/bench_minimal_loop.py [--model tiny|d256|both] [--prompts 8] [--repeats 5]

What the difference says: the part of dlm_engine's overhead that is the framework's own (its generality: the
trace-ready deltas, the health check, one host read serving loop and strategy, the policy interfaces), against
the part that is the algorithm's tensor operations, which any implementation pays; with the operation counts
beside it, whether that part is operations or Python. Nothing in the engine uses these loops.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

import bench_overhead  # noqa: E402  (a script's folder is on the import path: run as a script, or tests' load_experiment)
from dlm_engine.core.instrument import ModelTimer, SyncCounter  # noqa: E402
from dlm_engine.core.registry import load_plugins  # noqa: E402

NEG_INF = float("-inf")


def _fresh(prompt, gen, mask_id):
    """(prompt length, the canvas ``[1, P + gen]`` with the generation masked, its positions)."""
    P = len(prompt)
    return P, torch.tensor([list(prompt) + [mask_id] * gen]), torch.arange(P + gen)[None]


def _proposal(model, x, pos, s, e, masked, softmax_dtype=None):
    """The window's argmax tokens and, at its masked positions, their probabilities (``-inf`` elsewhere): the model
    called for the window's logits only, as the step loop calls it."""
    logits = model(x, position_ids=pos, logits_range=(s, e)).logits
    x0 = logits.argmax(-1)
    p = torch.softmax(logits, -1, dtype=softmax_dtype)
    return x0, torch.where(masked, p.gather(-1, x0[..., None])[..., 0], NEG_INF)


def minimal_threshold(model, prompt, gen, block, mask_id, tau=0.9):
    """Fast-dLLM's threshold decode, bare: per block, until it holds no mask, the top-1 masked position and every
    masked position whose float64 probability of its argmax token is >= ``tau``. Returns (tokens, steps)."""
    P, x, pos = _fresh(prompt, gen, mask_id)
    steps = 0
    for s in range(P, P + gen, block):
        xs = x[:, s:s + block]
        while True:
            m = xs == mask_id
            if not bool(m.any()):
                break
            x0, conf = _proposal(model, x, pos, s, s + block, m, torch.float64)
            sel = conf >= tau
            sel[0, conf.argmax(-1)] = True
            torch.where(sel, x0, xs, out=xs)
            steps += 1
    return x, steps


def minimal_low_confidence(model, prompt, gen, block, mask_id):
    """LLaDA's low-confidence remasking, bare, one token a step (steps = gen): per block, ``block`` steps, each
    committing the masked position whose model-dtype probability of its argmax token is highest."""
    P, x, pos = _fresh(prompt, gen, mask_id)
    steps = 0
    for s in range(P, P + gen, block):
        xs = x[:, s:s + block]
        for _ in range(block):
            x0, conf = _proposal(model, x, pos, s, s + block, xs == mask_id)
            i = conf.topk(1, dim=-1).indices
            xs.scatter_(1, i, x0.gather(1, i))
            steps += 1
    return x, steps


LOOPS = {"threshold": minimal_threshold, "low_confidence": minimal_low_confidence}


def run_minimal(model, prompts, gen, block, name, count_ops=False):
    """Decode every prompt with the minimal loop: (decode CPU s, model CPU s, steps, tokens per prompt).
    ``count_ops``: count the tensor operations outside the model instead (``run_minimal.ops``; the CPU figures of
    such a run include the counter's own work)."""
    timer = ModelTimer(model)
    mask_id = int(model.config.mask_token_id)
    cpu, steps, tokens = 0.0, 0, []
    counter = SyncCounter(timer) if count_ops else contextlib.nullcontext()
    with torch.inference_mode(), counter:
        for p in prompts:
            t0 = time.thread_time()
            x, n = LOOPS[name](timer, p, gen, block, mask_id)
            cpu += time.thread_time() - t0
            steps += n
            tokens.append(x.tolist())
    run_minimal.ops = counter.ops if count_ops else None
    return cpu, timer.cpu, steps, tokens


def ops_per_step(model, prompts, gen, block, name):
    """(minimal, dlm_engine) tensor operations a step outside the model, counted the same way
    (:class:`dlm_engine.core.instrument.SyncCounter`, views and host-made tensors included), one run each."""
    steps = run_minimal(model, prompts, gen, block, name, count_ops=True)[2]
    mini = run_minimal.ops / steps
    res = bench_overhead.one(model, prompts, gen, name, {"block_length": block}, "none", 1, instrument=("syncs",))
    return mini, res[6] / res[2]


def compare(model, prompts, gen, block, name, repeats):
    """(minimal, dlm_engine): each (outside-the-model CPU s, model CPU s, steps), the smallest outside figure of
    ``repeats`` runs; raises if the minimal loop's tokens or step count differ from dlm_engine's."""
    kw = {"block_length": block}
    best = {}
    for _ in range(repeats):
        for which in ("minimal", "dlm_engine"):
            if which == "minimal":
                cpu, mcpu, steps, tokens = run_minimal(model, prompts, gen, block, name)
            else:
                cpu, mcpu, steps = bench_overhead.one(model, prompts, gen, name, kw, "none", 1, instrument=())[:3]
                tokens = bench_overhead.one.tokens
            best.setdefault(which + " tokens", (tokens, steps))
            if which not in best or cpu - mcpu < best[which][0]:
                best[which] = (cpu - mcpu, mcpu, steps)
    t_min, s_min = best["minimal tokens"]
    t_eng, s_eng = best["dlm_engine tokens"]
    if t_min != t_eng or s_min != s_eng:
        raise AssertionError(f"{name}: the minimal loop made other tokens or steps ({s_min} vs {s_eng} steps)")
    return best["minimal"], best["dlm_engine"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny", choices=("tiny", "d256", "both"))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    load_plugins()
    for mname, model, gen, block, prompts, budget in bench_overhead.models(args.model):
        prompts = prompts[:args.prompts]
        print(f"\nmodel {mname}: gen {gen}, block {block}, {len(prompts)} prompts one by one, cache none, "
              f"budget {budget:.0f}%")
        print(f"{'strategy':<16}{'loop':<12}{'steps':>6}{'outside ms':>12}{'model ms':>10}{'ovh':>8}{'us/step':>9}"
              f"{'ops/step':>10}")
        for name in LOOPS:
            mini, eng = compare(model, prompts, gen, block, name, args.repeats)
            ops = ops_per_step(model, prompts, gen, block, name)
            for label, (o, m, n), k in (("minimal", mini, ops[0]), ("dlm_engine", eng, ops[1])):
                print(f"{name:<16}{label:<12}{n:>6}{o * 1e3:>12.3f}{m * 1e3:>10.3f}{o / (o + m):>8.1%}"
                      f"{o / n * 1e6:>9.0f}{k:>10.1f}")
            print(f"{'':<16}{'ratio':<12}{'':>6}{eng[0] / mini[0]:>11.2f}x  (same tokens and steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
