#!/usr/bin/env python3
"""Accuracy / NFE / TPS of the embedded tiny model under every strategy setting, per task.

    python experiments/eval_tiny.py [--model-path DIR] [--n 1000] [--batch 64] [--markdown]
    python experiments/eval_tiny.py --model tiny_bd --markdown        # the block-diffusion one (BD_SETTINGS)

Held-out prompts come from ``dlm_engine.app.tasks.held_out`` (a fixed seed never used in training).
Settings whose strategy is not registered are listed as skipped.
"""
from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from dlm_engine.app import tasks  # noqa: E402
from dlm_engine.app.api import LoadedModel, run_prompts  # noqa: E402
from dlm_engine.core.registry import CACHES, STRATEGIES, cache_class, load_plugins  # noqa: E402

SETTINGS = [
    ("low_confidence 1 tok/step", "low_confidence", {"steps": 16}),
    ("low_confidence 2 tok/step", "low_confidence", {"steps": 8}),
    ("low_confidence 4 tok/step", "low_confidence", {"steps": 4}),
    ("low_confidence 8 tok/step", "low_confidence", {"steps": 2}),
    ("low_confidence 16 tok/step", "low_confidence", {"steps": 1}),
    ("low_confidence semi-AR b4", "low_confidence", {"steps": 16, "block_length": 4}),
    ("low_confidence random remask", "low_confidence", {"steps": 16, "remasking": "random"}),
    ("threshold 0.9", "threshold", {"threshold": 0.9}),
    ("threshold 0.7", "threshold", {"threshold": 0.7}),
    ("threshold 0.5", "threshold", {"threshold": 0.5}),
    ("threshold 0.3", "threshold", {"threshold": 0.3}),
    ("factor 1.0", "factor", {"factor": 1.0}),
    ("factor 4.0", "factor", {"factor": 4.0}),
    ("cadllm defaults (b16)", "cadllm", {"initial_block_length": 16, "initial_steps": 8, "min_block": 4, "max_block": 16}),
    ("block_buffer 4x b4 t0.9", "block_buffer", {"block_length": 4, "buffer_size": 4, "accept_threshold": 0.9}),
    ("block_buffer 4x b4 t0.5", "block_buffer", {"block_length": 4, "buffer_size": 4, "accept_threshold": 0.5}),
]

# the embedded block-diffusion model (tiny_bd, blocks of 4): its family's decoder with the block KV store, and
# block-by-block strategies at the model's block size
BD_SETTINGS = [
    ("sdar defaults (4 steps/block)", "sdar", {}),
    ("sdar top_k=1 (greedy)", "sdar", {"top_k": 1}),
    ("sdar 2 steps/block", "sdar", {"denoising_steps": 2}),
    ("sdar 1 step/block", "sdar", {"denoising_steps": 1}),
    ("sdar threshold 0.9", "sdar", {"threshold": 0.9}),
    ("sdar threshold 0.7", "sdar", {"threshold": 0.7}),
    ("low_confidence b4 1 tok/step", "low_confidence", {"steps": 16, "block_length": 4}),
    ("threshold 0.9 b4", "threshold", {"threshold": 0.9, "block_length": 4}),
]
CACHE_OF = {"cadllm": "dual", "sdar": "block_kv"}


def load(path: str) -> LoadedModel:
    from dlm_engine.app.api import load_directory

    return load_directory(path)


def evaluate(lm: LoadedModel, examples, strategy: str, kwargs: dict, batch: int, gen_length: int = tasks.ANSWER_LENGTH):
    cls = STRATEGIES[strategy]
    conf = cls.Config(**kwargs)
    cache_name = CACHE_OF.get(strategy, "none")
    cache_name = cache_name if cache_name in CACHES else "none"
    ccls = cache_class(cache_name)
    ids = [lm.encode(e.prompt) for e in examples]
    torch.manual_seed(0)
    stats = run_prompts(lm, ids, lambda: cls(conf, gen_length), lambda: ccls(ccls.Config()), gen_length, batch)
    per_task = {}
    for row, ex in zip(stats.rows, examples):
        per_task.setdefault(ex.task, []).append(tasks.check(ex.task, ex.prompt, row.text))
    acc = sum(sum(v) for v in per_task.values()) / len(examples)
    nfe_row = sum(r.nfe for r in stats.rows) / len(stats.rows)
    return {"acc": acc, "by_task": {k: sum(v) / len(v) for k, v in per_task.items()}, "nfe": nfe_row,
            "tps": stats.tps}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None, help="checkpoint directory (default: the embedded model)")
    ap.add_argument("--model", default="tiny", help="the embedded model when no --model-path: tiny | tiny_bd")
    ap.add_argument("--n", type=int, default=1000, help="held-out prompts (>= 500 for the quality bar)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--only", default=None, help="run only settings whose label contains this string")
    ap.add_argument("--markdown", action="store_true", help="print a markdown table")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    load_plugins()
    path = args.model_path
    if path is None:
        from dlm_engine.checkpoints import embedded_path

        path = embedded_path(args.model)
        if path is None:
            print("eval_tiny: no embedded checkpoint; pass --model-path", file=sys.stderr)
            return 2
    lm = load(path)
    settings = BD_SETTINGS if getattr(lm.model, "block_diffusion", False) else SETTINGS
    examples = tasks.held_out(args.n)
    names = sorted({e.task for e in examples})
    head = ["setting", "accuracy", *names, "NFE/prompt", "TPS"]
    print(f"model {path}; {len(examples)} held-out prompts; batch {args.batch}")
    if args.markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "|".join("---" for _ in head) + "|")
    else:
        print(f"{'setting':<30}{'acc':>7}" + "".join(f"{n:>7}" for n in names) + f"{'NFE':>7}{'TPS':>9}")
    skipped = []
    for label, strategy, kwargs in settings:
        if args.only and args.only not in label:
            continue
        if strategy not in STRATEGIES:
            skipped.append(label)
            continue
        r = evaluate(lm, examples, strategy, kwargs, args.batch)
        cells = [f"{r['acc']:.1%}", *[f"{r['by_task'].get(n, 0):.0%}" for n in names], f"{r['nfe']:.2f}", f"{r['tps']:.0f}"]
        if args.markdown:
            print("| " + " | ".join([label, *cells]) + " |", flush=True)
        else:
            print(f"{label:<30}{cells[0]:>7}" + "".join(f"{c:>7}" for c in cells[1:-2]) + f"{cells[-2]:>7}{cells[-1]:>9}",
                  flush=True)
    if skipped:
        print("skipped (strategy not registered): " + ", ".join(skipped))
    return 0


if __name__ == "__main__":
    sys.exit(main())
