#!/usr/bin/env python3
"""Block-diffusion decoding with and without the block store (``cache=block_kv`` vs ``cache=none``).

    python experiments/bench_block_diffusion.py                 # both families, default sizes (~1 min on 2 cores)
    python experiments/bench_block_diffusion.py --family sdar --prompt 256 --gen 256 --reps 3

A random d256-class model of each family (hidden 256, 4 layers, 4 heads / 2 KV heads, vocabulary 2048; the
output head scaled so that confidences spread out and the thresholds commit several tokens on some steps) decodes
one prompt with its family's strategy (Fast-dLLM v2: ``fdv2`` blocks of 32, sub-blocks of 8, threshold 0.9;
SDAR: ``sdar`` eval sampler, blocks of 4, 4 denoising steps, top_k 1), once with every forward recomputing the
whole canvas (``none``) and once with the block store (``block_kv``). Configurations run interleaved (``--reps``
rounds after a warm-up). Reported per configuration: NFE, process CPU time and wall time of the decode (median
over the rounds), forward tokens per step (positions fed through the layers per forward, all layers alike) and
whether the two runs gave the same tokens (the block store is exact: they must).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from contextlib import contextmanager

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from dlm_engine.core.canvas import Canvas  # noqa: E402
from dlm_engine.core.loop import decode  # noqa: E402
from dlm_engine.core.registry import cache_class, load_plugins, strategy_class  # noqa: E402
from dlm_engine.models.qwen_bd import FastDLLMv2Config, FastDLLMv2Model, SDARConfig, SDARModel  # noqa: E402

VOCAB, BOS, MASK, EOS = 2048, 1900, 1922, 1901      # (EOS is never proposed: its head row is zeroed)
FAMILIES = {
    "fdv2": (FastDLLMv2Config, FastDLLMv2Model, "fdv2",
             dict(block_size=32, small_block_size=8, threshold=0.9, decode_mask_block=None)),
    "sdar": (SDARConfig, SDARModel, "sdar",
             dict(block_length=4, denoising_steps=4, top_k=1, threshold=0.9, stop_ids=[])),
}


def build(family: str, hidden: int = 256, layers: int = 4, head_scale: float = 6.0, seed: int = 0):
    cfg_cls, model_cls, _, _ = FAMILIES[family]
    kw = dict(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
              num_attention_heads=4, num_key_value_heads=2, bos_token_id=BOS, eos_token_id=EOS, mask_token_id=MASK)
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**kw))
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, head_scale / hidden ** 0.5)
        model.lm_head.weight[MASK].zero_()
        model.lm_head.weight[EOS].zero_()
    return model.eval()


@contextmanager
def counting(cache):
    """Positions fed through the layers by every model call (``ForwardCall.computed``)."""
    sizes = []
    inner = cache.forward

    @contextmanager
    def forward(call):
        with inner(call) as c:
            yield c
        sizes.append(int(c.computed))

    cache.forward = forward
    yield sizes


def run(model, family: str, cache_name: str, prompt, gen: int):
    _, _, sname, kw = FAMILIES[family]
    S = strategy_class(sname)
    C = cache_class(cache_name)
    cache = C(C.Config())
    canvas = Canvas.from_prompts([prompt], gen, MASK, EOS, eos_id=EOS)
    with counting(cache) as sizes:
        torch.manual_seed(0)
        c0, w0 = time.process_time(), time.perf_counter()
        decode(model, canvas, S(S.Config(**kw), gen), cache=cache)
        cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    return dict(nfe=canvas.nfe, cpu=cpu, wall=wall, tokens=canvas.tokens.tolist(),
                per_step=sum(sizes) / max(1, len(sizes)), masked=int(canvas.masked().sum()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", default="fdv2,sdar")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    load_plugins()
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 1800, (args.prompt,), generator=g).tolist()
    print(f"prompt {args.prompt}, generation {args.gen}, {args.reps} rounds, {args.threads} thread(s)")
    print(f"{'family':6} {'cache':9} {'NFE':>5} {'CPU s':>8} {'wall s':>8} {'tok/fwd':>8} {'CPU x':>6} same")
    with torch.inference_mode():
        for family in args.family.split(","):
            if family not in FAMILIES:
                print(f"bench_block_diffusion: unknown family '{family}' (choose {', '.join(FAMILIES)})", file=sys.stderr)
                return 2
            model = build(family)
            run(model, family, "block_kv", prompt[:16], 16)                  # warm-up
            rounds = {c: [] for c in ("none", "block_kv")}
            for _ in range(args.reps):
                for cache in rounds:
                    rounds[cache].append(run(model, family, cache, prompt, args.gen))
            base = statistics.median(r["cpu"] for r in rounds["none"])
            ref = rounds["none"][0]["tokens"]
            for cache, rs in rounds.items():
                cpu = statistics.median(r["cpu"] for r in rs)
                wall = statistics.median(r["wall"] for r in rs)
                r = rs[0]
                print(f"{family:6} {cache:9} {r['nfe']:5d} {cpu:8.3f} {wall:8.3f} {r['per_step']:8.1f} "
                      f"{base / cpu:6.2f} {r['tokens'] == ref}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
