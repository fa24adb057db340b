#!/usr/bin/env python3
"""Decode throughput and framework overhead of `low_confidence` on the tiny model.

For generation lengths 64/128/256 and batch sizes 1 and 8 (one token per step, block 32):
tokens/s, NFE, and framework overhead = wall time outside the model forward / total wall time.

    python experiments/bench_decode.py [--model-path DIR] [--repeats 3]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from dlm_engine.core.canvas import Canvas  # noqa: E402
from dlm_engine.core.loop import decode  # noqa: E402
from dlm_engine.core.registry import strategy_class  # noqa: E402


def default_model(path):
    from dlm_engine.models.loader import build_random, load_pretrained

    if path is None:
        from dlm_engine.checkpoints import embedded_path

        path = embedded_path()
    if path is not None and os.path.isdir(path):
        return load_pretrained(path)[0], f"checkpoint {path}"
    cfg = dict(model_type="llada", d_model=128, n_heads=4, n_layers=4, mlp_hidden_size=384, vocab_size=100,
               embedding_size=128, rope_theta=10000.0, mask_token_id=3, eos_token_id=2, pad_token_id=0)
    return build_random(cfg, seed=0)[0], "random tiny (d128, 4 layers)"


class TimedModel:
    """Wraps a model and accumulates the wall time spent inside forward calls."""

    def __init__(self, model):
        self.model = model
        self.seconds = 0.0
        self.calls = 0

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        out = self.model(*args, **kwargs)
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        return out


def bench(model, gen_length, batch, repeats, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(5, 100, (int(torch.randint(6, 14, (1,), generator=g)),), generator=g).tolist()
               for _ in range(batch)]
    cls = strategy_class("low_confidence")
    conf = cls.Config(steps=gen_length, block_length=32)
    walls, fwd, nfe = [], [], 0
    for rep in range(repeats + 1):
        timed = TimedModel(model)
        canvas = Canvas.from_prompts(prompts, gen_length, 3, 0)
        t0 = time.perf_counter()
        decode(timed, canvas, cls(conf, gen_length))
        wall = time.perf_counter() - t0
        if rep == 0:
            continue  # warm-up
        walls.append(wall)
        fwd.append(timed.seconds)
        nfe = canvas.nfe
    wall = statistics.median(walls)
    model_s = statistics.median(fwd)
    return {"gen": gen_length, "batch": batch, "nfe": nfe, "wall_s": wall,
            "tok_s": gen_length * batch / wall, "overhead": max(0.0, wall - model_s) / wall}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, desc = default_model(args.model_path)
    print(f"model: {desc}; strategy low_confidence, 1 token/step, block 32; median of {args.repeats} runs")
    print(f"{'gen':>5} {'batch':>5} {'NFE':>5} {'wall s':>8} {'tokens/s':>9} {'overhead':>9}")
    for batch in (1, 8):
        for gen in (64, 128, 256):
            r = bench(model, gen, batch, args.repeats)
            print(f"{r['gen']:>5} {r['batch']:>5} {r['nfe']:>5} {r['wall_s']:>8.3f} {r['tok_s']:>9.1f} {r['overhead']:>8.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
