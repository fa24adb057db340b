#!/usr/bin/env python3
"""MoE dispatch of the LLaDA2 family: batched expert dispatch against a per-token loop, and a decode with and
without the block store, on a random d256-class LLaDA2 MoE model (CPU).

    python experiments/bench_moe.py [--tokens 32,128,512] [--repeat 5] [--threads 1] [--decode]

Printed per token count: the routed experts' time (router excluded, the same for both) per call, batched
(:func:`dlm_engine.models.llada2.dispatch`: pairs sorted by expert, one matmul per active expert) and per token
(:func:`dispatch_per_token`: each token's k experts one by one), their ratio, and the largest difference of the
outputs. With ``--decode``: one ``llada2`` decode (gen 64, block 16) with ``cache=none`` (the reference's
recompute-everything path) and ``cache=block_store``: CPU time, NFE and positions fed through the layers per
step (tokens must match).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

CONFIG = dict(model_type="llada2_moe", vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=64, partial_rotary_factor=0.5,
              num_experts=64, num_experts_per_tok=8, n_group=8, topk_group=4, routed_scaling_factor=2.5,
              moe_intermediate_size=128, num_shared_experts=1, first_k_dense_replace=1, pad_token_id=4000,
              max_position_embeddings=4096, rope_theta=10000.0)


def build():
    from dlm_engine.models.loader import build_random

    model = build_random(CONFIG, seed=0)[0]
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in model.model.layers[CONFIG["first_k_dense_replace"]:]:
            gate = layer.mlp.gate                   # (the 0.02 init routes every token alike: spread the routing)
            gate.weight.copy_(torch.randn(gate.weight.shape, generator=g) / CONFIG["hidden_size"] ** 0.5)
            gate.expert_bias.copy_(0.1 * torch.randn(gate.expert_bias.shape, generator=g))
    return model


def timed(fn, repeat: int) -> float:
    fn()                                            # warm-up
    ts = []
    for _ in range(repeat):
        t = time.process_time()
        fn()
        ts.append(time.process_time() - t)
    return statistics.median(ts)


def bench_dispatch(model, tokens, repeat: int) -> None:
    from dlm_engine.models.llada2 import dispatch, dispatch_per_token

    moe = model.model.layers[1].mlp
    print(f"MoE dispatch, d={CONFIG['hidden_size']}, {CONFIG['num_experts']} experts, "
          f"k={CONFIG['num_experts_per_tok']}, "
          f"expert width {CONFIG['moe_intermediate_size']} (CPU time per call, median of {repeat})")
    print(f"{'tokens':>7} {'active':>6} {'batched ms':>11} {'per-token ms':>13} {'ratio':>7} {'max diff':>9}")
    g = torch.Generator().manual_seed(2)
    for n in tokens:
        x = torch.randn(n, CONFIG["hidden_size"], generator=g)
        with torch.inference_mode():
            idx, w = moe.gate(x)
            a = timed(lambda: dispatch(x, idx, w, moe.experts), repeat)
            b = timed(lambda: dispatch_per_token(x, idx, w, moe.experts), max(1, repeat // 2))
            diff = (dispatch(x, idx, w, moe.experts) - dispatch_per_token(x, idx, w, moe.experts)).abs().max().item()
        active = int(idx.unique().numel())
        print(f"{n:>7} {active:>6} {a * 1e3:>11.2f} {b * 1e3:>13.2f} {b / a:>6.1f}x {diff:>9.1e}")


def bench_decode(model) -> None:
    from dlm_engine.core.canvas import Canvas
    from dlm_engine.core.loop import decode
    from dlm_engine.core.registry import cache_class, load_plugins, strategy_class

    load_plugins()
    prompt = list(range(100, 137))
    out = {}
    print("\nllada2 decode, prompt 37, gen 64 (whole blocks of 16), threshold 0.5")
    print(f"{'cache':>12} {'CPU s':>7} {'NFE':>4} {'positions/step':>15}")
    for cache in ("none", "block_store"):
        cls = strategy_class("llada2")
        strategy = cls(cls.Config(block_length=16, steps=16, threshold=0.5), 64)
        canvas = Canvas.from_prompts([prompt], 64 + (-(37 + 64) % 16), model.mask_token_id, 4000)
        c = cache_class(cache)(cache_class(cache).Config())
        computed = []
        inner = c.forward

        def watch(call, inner=inner):
            cm = inner(call)

            class Ctx:
                def __enter__(self):
                    return cm.__enter__()

                def __exit__(self, *a):
                    computed.append(call.computed)
                    return cm.__exit__(*a)

            return Ctx()

        c.forward = watch
        t = time.process_time()
        decode(model, canvas, strategy, cache=c)
        dt = time.process_time() - t
        out[cache] = canvas.tokens.clone()
        print(f"{cache:>12} {dt:>7.2f} {canvas.nfe:>4} {sum(computed) / max(1, len(computed)):>15.1f}")
    print("tokens equal:", torch.equal(out["none"], out["block_store"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="32,128,512")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--decode", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = build()
    bench_dispatch(model, [int(t) for t in args.tokens.split(",")], args.repeat)
    if args.decode:
        bench_decode(model)


if __name__ == "__main__":
    main()
