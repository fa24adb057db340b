#!/usr/bin/env python3
"""Early stop at EOS: NFE, generated tokens, accuracy and wall time with and without
``strategy.stop_at_eos`` (low_confidence), on the tiny task mix.

    python experiments/bench_eos_stop.py [MODEL_DIR] [--n 64] [--gen 16] [--batch 1] [--block 4]

MODEL_DIR: a trained tiny checkpoint (default: the embedded ``model=tiny``). Prints one line per setting
and the ratios. With batch 1 every row that ends early saves forwards; in larger batches a batch stops
when its last row ends, and until then the model runs on the unfinished rows only (see
experiments/bench_finished_rows.py for that saving).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402


def main(argv=None) -> int:
    from dlm_engine.checkpoints import embedded_path
    from dlm_engine.app.api import run_prompts
    from dlm_engine.core.registry import cache_class, load_plugins, strategy_class
    from dlm_engine.app.tasks import check, held_out

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir", nargs="?", default=None)
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--gen", type=int, default=16)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--block", type=int, default=None, help="strategy.block_length (default: gen, one block)")
    args = ap.parse_args(argv)
    path = args.model_dir or embedded_path("tiny")
    if not path:
        print("bench_eos_stop: no model directory given and no embedded tiny checkpoint", file=sys.stderr)
        return 2
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    load_plugins()

    from dlm_engine.app.api import load_directory

    lm = load_directory(str(path))
    examples = held_out(args.n)
    ids = [lm.encode(e.prompt) for e in examples]
    cls = strategy_class("low_confidence")
    none = cache_class("none")
    rows = {}
    for stop in (False, True):
        conf = cls.Config(stop_at_eos=stop, block_length=args.block)
        torch.manual_seed(0)
        t0 = time.perf_counter()
        stats = run_prompts(lm, ids, lambda: cls(conf, args.gen), lambda: none(none.Config()), args.gen, args.batch)
        wall = time.perf_counter() - t0
        acc = sum(check(e.task, e.prompt, r.text) for e, r in zip(examples, stats.rows)) / len(examples)
        rows[stop] = (stats.model_calls, stats.generated_tokens, acc, stats.wall_time, wall)
        print(f"stop_at_eos={str(stop):5s}  model calls {stats.model_calls:5d}  NFE (sum per sequence) {stats.nfe:5d}  "
              f"generated tokens {stats.generated_tokens:5d}  "
              f"accuracy {acc:.3f}  decode time {stats.wall_time:.2f}s  TPS {stats.tps:.1f}")
    (n0, g0, a0, t0_, _), (n1, g1, a1, t1, _) = rows[False], rows[True]
    print(f"ratios (stop / no stop): model calls {n1 / n0:.3f}  decode time {t1 / t0_:.3f}  "
          f"same accuracy: {a0 == a1}  same generated tokens: {g0 == g1}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
