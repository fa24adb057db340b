#!/usr/bin/env python3
"""Every decoding strategy at its reference defaults and a few settings, on one model and the built-in
held-out prompts: accuracy, NFE, TPF, TPS, framework overhead and speed-up over ``low_confidence`` at
one token per step (the baseline row, measured in the same run).

    python experiments/bench_strategies.py [--model-path DIR] [--n 64] [--batch-size 8] [--repeats 3]

Model: ``--model-path`` (an official-format checkpoint directory with a tokenizer), else the embedded
model (``dlm_engine/checkpoints/tiny``) when it exists, else the seeded random ``tiny_random`` model
(mechanics only: its accuracy is meaningless). Definitions (docs/running.md, "Metric definitions"): NFE = forwards
each sequence took part in until it finished, summed; generated tokens = generation up to and including the
first EOS; TPF = tokens / NFE; TPS =
tokens / decode wall time (after a warm-up; best of ``--repeats`` interleaved runs); overhead = wall time outside
``model.forward`` / wall time; speed-up = TPS / TPS of the baseline, NFE ratio = baseline NFE / NFE.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from types import SimpleNamespace

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from dlm_engine.app import tasks  # noqa: E402
from dlm_engine.errors import UserError  # noqa: E402
from dlm_engine.app.api import decode_batch, load_model, rows_from_canvas, sync  # noqa: E402
from dlm_engine.core.steps import BatchSteps  # noqa: E402
from dlm_engine.core.registry import cache_class, load_plugins, strategy_class  # noqa: E402

BASELINE = ("low_confidence", {}, "1 token/step (baseline)")

# (strategy, overrides, note); {} = the strategy's reference defaults. gen_length is filled in at run time.
SETTINGS = [
    ("low_confidence", {"steps_div": 2}, "2 tokens/step"),
    ("threshold", {}, "defaults (0.9)"),
    ("threshold", {"threshold": 0.7}, ""),
    ("threshold", {"threshold": 0.5}, ""),
    ("threshold", {"threshold": 0.9, "block_length": 4}, "block 4"),
    ("threshold", {"threshold": 0.9, "cache": "dual", "block_length": 4}, "block 4, dual cache"),
    ("factor", {}, "defaults (1.0)"),
    ("factor", {"factor": 2.0}, ""),
    ("factor", {"factor": 4.0}, ""),
    ("early_exit", {}, "defaults (no answer window)"),
    ("early_exit", {"answer_start": 0}, "window [0,5), 7.5/5/2.5"),
    ("early_exit", {"answer_start": 0, "early_threshold": 4.0, "mid_threshold": 3.0, "late_threshold": 2.0},
     "window [0,5), 4/3/2"),
    ("cadllm", {}, "defaults"),
    ("block_buffer", {}, "defaults (block 32)"),
    ("block_buffer", {"block_length": 4, "buffer_size": 1}, "block 4, buffer 1"),
    ("block_buffer", {"block_length": 4, "buffer_size": 2}, "block 4, buffer 2"),
    ("block_buffer", {"block_length": 4, "buffer_size": 4}, "block 4, buffer 4"),
    # the d2Cache family (strategies/d2c.py, klass.py, ar.py, wino.py)
    ("d2c", {}, "defaults (1 token/step)"),
    ("d2c", {"num_transfer_tokens": 2}, "2 tokens/step"),
    ("d2c", {"threshold": 0.9}, "threshold 0.9"),
    ("d2c", {"threshold": 0.7}, "threshold 0.7"),
    ("d2c", {"factor": 1.0}, "factor 1.0 (d2Cache rule)"),
    ("d2c", {"sigma": 10.0, "threshold": 0.9}, "certainty prior 10, thr 0.9"),
    ("d2c", {"debias": True, "threshold": 0.9}, "PC-Sampler, thr 0.9 (*)"),
    ("d2c", {"gamma": 0.001}, "EB-Sampler gamma 0.001"),
    ("d2c", {"gamma": 0.1}, "EB-Sampler gamma 0.1"),
    ("d2c", {"gamma": 1.0}, "EB-Sampler gamma 1.0"),
    ("klass", {"threshold": 0.9}, "threshold 0.9"),
    ("klass", {"threshold": 0.7, "kl_threshold": 0.05}, "thr 0.7, kl 0.05"),
    ("ar", {}, "defaults (whole run, quirk 9)"),
    ("ar", {"threshold": 0.9}, "threshold 0.9"),
    ("ar", {"threshold": 0.5}, "threshold 0.5"),
    ("wino", {}, "defaults (0.7 / 0.9)"),
    ("wino", {"wide_in_thres": 0.5}, "wide-in 0.5"),
    ("wino", {"wide_in_thres": 0.5, "narrow_out_thres": 0.95}, "wide-in 0.5, narrow-out 0.95"),
]


class TimedForward:
    """Callable model wrapper that accumulates the wall time spent in ``model.forward``."""

    def __init__(self, model):
        self.model, self.seconds = model, 0.0

    def __getattr__(self, name):       # config, logits_shift, device, ... of the wrapped model
        return getattr(self.model, name)

    def __call__(self, *args, **kwargs):
        sync(self.model.device)
        t0 = time.perf_counter()
        out = self.model(*args, **kwargs)
        sync(self.model.device)
        self.seconds += time.perf_counter() - t0
        return out


def pick_model(path):
    if path is None:
        from dlm_engine.checkpoints import embedded_path

        path = embedded_path()
    if path is not None:
        return SimpleNamespace(name=os.path.basename(os.path.normpath(path)), path=path, random=None), path

    from dlm_engine.app.config import model_preset

    node = model_preset("tiny_random")
    return SimpleNamespace(name="tiny_random", path=None, random=node.random, random_seed=node.random_seed), \
        "tiny_random (seeded random weights: accuracy is meaningless)"


def build(name, overrides, gen_length):
    kw = dict(overrides)
    cache = kw.pop("cache", None)
    cls = strategy_class(name)
    if "steps_div" in kw:
        kw["steps"] = gen_length // kw.pop("steps_div")
    if name == "low_confidence" and not kw:
        kw = {"steps": gen_length, "block_length": gen_length}
    cache = cache or ("dual" if name == "cadllm" else "none")
    conf = cls.Config(**kw)
    cls(conf, gen_length)  # validate now: a setting that does not apply is reported, not crashed on
    return (lambda: cls(conf, gen_length)), (lambda: cache_class(cache)(cache_class(cache).Config())), cache


def run_once(lm, ids, make_strategy, make_cache, gen_length, batch_size):
    """One pass over all prompts: (rows, model calls, decode wall time, time inside model.forward)."""
    timed = TimedForward(lm.model)
    tlm = dataclasses.replace(lm, model=timed)
    rows, calls, wall = [], 0, 0.0
    cap = make_strategy().max_batch          # CadLLM decodes one row at a time (run_prompts splits the same way)
    if cap is not None:
        batch_size = min(batch_size, cap)
    torch.manual_seed(0)
    for start in range(0, len(ids), batch_size):
        chunk = ids[start:start + batch_size]
        log = BatchSteps()
        sync(lm.device)
        t0 = time.perf_counter()
        canvas = decode_batch(tlm, chunk, make_strategy(), make_cache(), gen_length, sinks=[log])
        sync(lm.device)
        wall += time.perf_counter() - t0
        calls += canvas.nfe
        rows += rows_from_canvas(lm, canvas, chunk, None, start, log.metrics(canvas, lm.eos_id))
    return rows, calls, wall, timed.seconds


def summarize(runs, examples):
    """Best (least disturbed) of the repeats for time; tokens and accuracy are deterministic. NFE is per
    sequence (forwards the sequence took part in), TPF = tokens / sequence NFE summed over sequences."""
    rows, calls, wall, fwd = min(runs, key=lambda r: r[2])
    tokens = sum(r.generated_tokens for r in rows)
    nfe = sum(r.nfe for r in rows)
    correct = sum(tasks.check(e.task, e.prompt, r.text) for e, r in zip(examples, rows))
    return {"nfe": nfe, "nfe_per_prompt": nfe / len(rows), "model_calls": calls, "tokens": tokens,
            "accuracy": correct / len(rows), "tpf": tokens / nfe, "tps": tokens / wall, "wall_s": wall,
            "overhead": max(0.0, wall - fwd) / wall}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--n", type=int, default=64, help="held-out prompts (dlm_engine.app.tasks.held_out)")
    ap.add_argument("--gen-length", type=int, default=tasks.ANSWER_LENGTH)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    load_plugins()
    model_cfg, desc = pick_model(args.model_path)
    lm = load_model(model_cfg, args.device, "float32")
    examples = tasks.held_out(args.n)
    ids = [lm.encode(e.prompt) for e in examples]
    G = args.gen_length
    with torch.inference_mode():   # warm-up
        decode_batch(lm, ids[:args.batch_size], build(*BASELINE[:2], G)[0](), None, G)
    print(f"model: {desc}\n{len(ids)} held-out prompts, gen_length {G}, batch {args.batch_size}, device "
          f"{lm.device}, best of {args.repeats} interleaved runs")
    jobs = []
    for name, ov, note in [BASELINE] + SETTINGS:
        label = note or ", ".join(f"{k}={v}" for k, v in ov.items())
        try:
            jobs.append((name, label) + build(name, ov, G))
        except (UserError, KeyError) as exc:
            print(f"not run: {name} {label}: {exc}")
    runs = {i: [] for i in range(len(jobs))}
    for _ in range(args.repeats):          # interleaved, so a busy moment does not hit one setting only
        for i, (_, _, make_s, make_c, _) in enumerate(jobs):
            runs[i].append(run_once(lm, ids, make_s, make_c, G, args.batch_size))
    head = (f"{'strategy':<15}{'setting':<31}{'cache':<7}{'acc':>6}{'NFE/prompt':>11}{'TPF':>6}{'TPS':>9}{'ovh':>7}"
            f"{'speed-up':>9}{'NFE x':>7}")
    print(head + "\n" + "-" * len(head))
    out = []
    for i, (name, label, _, _, cache) in enumerate(jobs):
        r = summarize(runs[i], examples)
        base = out[0] if out else r
        r.update(strategy=name, setting=label, cache=cache, speedup=r["tps"] / base["tps"], nfe_ratio=base["nfe"] / r["nfe"])
        out.append(r)
        print(f"{name:<15}{label:<31}{cache:<7}{r['accuracy']:>6.3f}{r['nfe_per_prompt']:>11.2f}{r['tpf']:>6.2f}"
              f"{r['tps']:>9.0f}{r['overhead']:>7.1%}{r['speedup']:>8.2f}x{r['nfe_ratio']:>6.2f}x")
    print("(*) the embedded model's character vocabulary is not the tokenizer the bundled PC-Sampler table counts;"
          " the row shows the mechanics only")
    frontier(out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": desc, "n": len(ids), "gen_length": G, "rows": out}, f, indent=1)
    return 0


def frontier(out):
    """Settings on the accuracy-vs-NFE Pareto front (no other setting is at least as accurate with fewer NFE)."""
    front = [r for r in out if not any(o["accuracy"] >= r["accuracy"] and o["nfe"] < r["nfe"]
                                       or o["accuracy"] > r["accuracy"] and o["nfe"] <= r["nfe"] for o in out)]
    ref = next((r for r in out if r["strategy"] == "threshold" and r["setting"].startswith("defaults")), None)
    print("accuracy-vs-NFE frontier: " + "; ".join(f"{r['strategy']} {r['setting']} ({r['accuracy']:.3f}, "
                                                  f"{r['nfe_per_prompt']:.2f})" for r in sorted(front, key=lambda r: r["nfe"])))
    if ref is not None:
        beat = [r for r in out if r["accuracy"] >= ref["accuracy"] and r["nfe"] < ref["nfe"] and r is not ref]
        print(f"better than threshold 0.9 ({ref['accuracy']:.3f} at {ref['nfe_per_prompt']:.2f} NFE/prompt): "
              + ("; ".join(f"{r['strategy']} {r['setting']}" for r in beat) or "none"))


if __name__ == "__main__":
    sys.exit(main())
