#!/usr/bin/env python3
"""Finished rows stop costing work: batched ``stop_at_eos`` decoding with and without compaction.

    python experiments/bench_finished_rows.py [MODEL_DIR] [--n 64] [--gen 32] [--batch 16] [--block 8]
                                              [--cache none] [--repeats 3]

MODEL_DIR: a trained tiny checkpoint (default: the embedded ``model=tiny``). For each strategy
(low_confidence, threshold; both with ``stop_at_eos=true``, T = 0) the prompts are decoded in batches with
``decode(..., compact=True)`` (the model runs on the active rows only) and ``compact=False`` (finished rows
ride along). Prints model calls, NFE (the strategies' count), *row-forwards* (sum over model calls of the
rows in the call: the work done) and decode wall time (best of ``--repeats``), the ratios, and checks that
both runs produce the same tokens, commit steps and per-row NFE.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402


class Counting:
    """Counts model calls and the rows they run."""

    def __init__(self, model):
        self.model, self.calls, self.rows = model, 0, 0

    def __call__(self, ids, **kw):
        self.calls += 1
        self.rows += int(ids.shape[0])
        return self.model(ids, **kw)


def main(argv=None) -> int:
    from dlm_engine.core.canvas import Canvas
    from dlm_engine.checkpoints import embedded_path
    from dlm_engine.app.api import generated_token_count, load_directory
    from dlm_engine.core.loop import decode
    from dlm_engine.core.registry import cache_class, load_plugins, strategy_class
    from dlm_engine.app.tasks import held_out

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir", nargs="?", default=None)
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--cache", default="none")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    path = args.model_dir or embedded_path("tiny")
    if not path:
        print("bench_finished_rows: no model directory given and no embedded tiny checkpoint", file=sys.stderr)
        return 2
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    load_plugins()
    lm = load_directory(str(path))
    ids = [lm.encode(e.prompt) for e in held_out(args.n)]
    batches = [ids[i:i + args.batch] for i in range(0, len(ids), args.batch)]
    ccls = cache_class(args.cache)
    settings = {
        "low_confidence": dict(block_length=args.block, stop_at_eos=True),
        "threshold": dict(block_length=args.block, threshold=0.9, stop_at_eos=True),
    }
    print(f"model {path}  prompts {len(ids)}  batch {args.batch}  gen {args.gen}  block {args.block}  "
          f"cache {args.cache}  (T = 0, stop_at_eos=true)")
    for name, kw in settings.items():
        cls = strategy_class(name)
        res = {}
        for compact in (False, True):
            best, out = float("inf"), None
            for _ in range(max(1, args.repeats)):
                m = Counting(lm.model)
                nfe, canvases, wall = 0, [], 0.0
                for chunk in batches:
                    canvas = Canvas.from_prompts(chunk, args.gen, lm.mask_id, lm.pad_id, eos_id=lm.eos_id,
                                                 eot_id=lm.eot_id)
                    strat, cache = cls(cls.Config(**kw), args.gen), ccls(ccls.Config())
                    t0 = time.perf_counter()
                    decode(m, canvas, strat, cache=cache, compact=compact)
                    wall += time.perf_counter() - t0
                    nfe += canvas.nfe
                    canvases.append(canvas)
                if wall < best:
                    best, out = wall, (m.calls, nfe, m.rows, canvases)
            calls, nfe, rows, canvases = out
            gen_tokens = sum(generated_token_count(r, lm.eos_id) for c in canvases
                             for r in c.tokens[:, c.gen_start:].tolist())
            row_nfe = sum(int(c.row_nfe.sum()) for c in canvases)
            res[compact] = (calls, nfe, rows, best, canvases)
            print(f"{name:15s} compact={str(compact):5s}  model calls {calls:5d}  NFE {nfe:5d}  "
                  f"row-forwards {rows:6d}  sum(row_nfe) {row_nfe:6d}  generated tokens {gen_tokens:5d}  "
                  f"decode time {best:.3f}s")
        (c0, n0, r0, t0_, cv0), (c1, n1, r1, t1, cv1) = res[False], res[True]
        same = all(torch.equal(a.tokens, b.tokens) and torch.equal(a.step_of, b.step_of)
                   and torch.equal(a.row_nfe, b.row_nfe) for a, b in zip(cv0, cv1))
        print(f"{name:15s} ratios (compact / not): row-forwards {r1 / r0:.3f}  model calls {c1 / c0:.3f}  "
              f"NFE {n1 / n0:.3f}  decode time {t1 / t0_:.3f}  identical tokens/steps/row_nfe: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
