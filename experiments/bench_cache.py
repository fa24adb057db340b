#!/usr/bin/env python3
"""KV-cache benchmark: none / prefix / dual x low_confidence / threshold on a LLaDA-shaped random model.

    python experiments/bench_cache.py [--d-model 256] [--layers 4] [--gen 256] [--block 32] [--device cpu]

The model has LLaDA's architecture with random weights; its output head is scaled so that confidences
spread out (the threshold rule then commits several tokens per step, as with a trained model). Every
configuration decodes the same left-padded batch once, after a warm-up; all figures come from one run:
NFE, generated tokens per second (decode wall time, device synchronised), the speed-up over the
uncached run of the same strategy (also in process CPU time, which is steadier on a shared machine),
and the token agreement rate (fraction of generated positions whose
token equals the uncached run's).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from dlm_engine.core.canvas import Canvas  # noqa: E402
from dlm_engine.core.loop import decode  # noqa: E402
from dlm_engine.models.llada import LLaDAConfig, LLaDAModelLM  # noqa: E402
from dlm_engine.core.registry import cache_class, strategy_class  # noqa: E402

MASK, PAD = 2000, 2001


def build_model(d_model: int, layers: int, vocab: int, head_scale: float, device, seed: int = 0):
    torch.manual_seed(seed)
    heads = max(1, d_model // 64)
    cfg = LLaDAConfig(d_model=d_model, n_heads=heads, n_layers=layers, mlp_hidden_size=int(d_model * 8 / 3) // 16 * 16,
                      vocab_size=vocab, embedding_size=vocab, max_sequence_length=4096, rope_theta=500000.0,
                      mask_token_id=MASK, eos_token_id=PAD, pad_token_id=PAD)
    model = LLaDAModelLM(cfg)
    with torch.no_grad():
        head = model.model.transformer.ff_out.weight
        head.normal_(0.0, head_scale / d_model ** 0.5)   # logit std ~ head_scale: confidences spread out
        head[MASK].zero_()                               # the mask token is never proposed
    return model.to(device).eval()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(model, prompts, gen, strategy, conf, cache, device):
    cls = strategy_class(strategy)
    canvas = Canvas.from_prompts(prompts, gen, MASK, PAD, device=device)
    c = cache_class(cache)(cache_class(cache).Config())
    sync(device)
    t0, c0 = time.perf_counter(), time.process_time()
    decode(model, canvas, cls(cls.Config(**conf), gen), cache=c)
    sync(device)
    return canvas, time.perf_counter() - t0, time.process_time() - c0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--gen", type=int, default=256)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--prompt-lens", default="40,28", help="comma-separated prompt lengths (one batch, left-padded)")
    ap.add_argument("--steps", type=int, default=None, help="low_confidence steps (default: gen / 2, 2 tokens per step)")
    ap.add_argument("--threshold", type=float, default=0.9)
    ap.add_argument("--head-scale", type=float, default=15.0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    model = build_model(args.d_model, args.layers, args.vocab, args.head_scale, device)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, MASK, (int(n),), generator=g).tolist() for n in args.prompt_lens.split(",")]
    strategies = {
        "low_confidence": dict(steps=args.steps or args.gen // 2, block_length=args.block, loop="fastdllm"),
        "threshold": dict(threshold=args.threshold, block_length=args.block),
    }
    with torch.inference_mode():                                    # warm-up (kernels, allocator)
        run(model, prompts, args.block, "threshold", dict(threshold=args.threshold, block_length=args.block),
            "dual", device)
    print(f"model: LLaDA-shaped random, d_model {args.d_model}, {args.layers} layers, vocab {args.vocab}; "
          f"batch {len(prompts)} (prompts {args.prompt_lens}), gen {args.gen}, block {args.block}, "
          f"device {device}" + (f" ({args.threads} threads)" if device.type == "cpu" else ""))
    head = (f"{'strategy':<15} {'cache':<7} {'NFE':>5} {'tokens':>6} {'wall s':>7} {'tok/s':>8} {'speed-up':>8} "
            f"{'cpu s':>7} {'cpu x':>6} {'agree':>6}")
    print(head)
    print("-" * len(head))
    for name, conf in strategies.items():
        base = None
        for cache in ("none", "prefix", "dual"):
            canvas, secs, cpu = run(model, prompts, args.gen, name, conf, cache, device)
            gen_tokens = canvas.batch_size * args.gen
            toks = canvas.tokens[:, canvas.gen_start:]
            if base is None:
                base = (toks, secs, cpu)
            agree = (toks == base[0]).float().mean().item()
            print(f"{name:<15} {cache:<7} {canvas.nfe:>5} {gen_tokens:>6} {secs:>7.2f} {gen_tokens / secs:>8.1f} "
                  f"{base[1] / secs:>7.2f}x {cpu:>7.2f} {base[2] / cpu:>5.2f}x {agree:>6.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
