#!/usr/bin/env python3
"""KV-cache benchmark: none / prefix / dual / dllm / d2cache x low_confidence / threshold.

    python experiments/bench_cache.py                       # both parts, default sizes (a few minutes on 2 cores)
    python experiments/bench_cache.py --part random --gen 256,1024 --reps 2     # the big configuration
    python experiments/bench_cache.py --part tasks --n 1000

(a) ``tasks``: the embedded tiny model on its held-out task mix (generation 16, blocks of 8): accuracy, NFE per
prompt and generated tokens per second of every cache under both strategies. Batched, so ``dllm`` runs with
``per_row_schedule=true`` (its reference schedule is shared by a batch and stops when rows diverge).

(b) ``random``: a LLaDA-shaped model with random weights (default d_model 512, 8 layers, blocks of 32) whose output
head is scaled so that confidences spread out (the threshold rule then commits several tokens per step, as with a
trained model). For every generation length the configurations run interleaved (``--reps`` rounds of every
strategy x cache, after a warm-up), so load on a shared machine affects them alike. Reported per configuration:
NFE, generated tokens per second (decode wall time, device synchronised), the speed-up over the uncached run of the
same strategy in wall time and in process CPU time (steadier on a shared machine), the recomputed fraction (positions
that went through a layer's projections, summed over layers, over all positions x layers, averaged over the calls)
and the token agreement with the uncached run (fraction of generated positions with the same token).

``low_confidence`` runs Fast-dLLM's loop (``loop=fastdllm``: a block ends when it is full), which is what lets it
pair with d2Cache (whose calls give logits only for the positions it recomputes).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from contextlib import contextmanager

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from dlm_engine.core.canvas import Canvas  # noqa: E402
from dlm_engine.core.loop import decode  # noqa: E402
from dlm_engine.core.registry import cache_class, load_plugins, strategy_class  # noqa: E402
from dlm_engine.models.llada import LLaDAConfig, LLaDAModelLM  # noqa: E402

MASK, PAD = 2000, 2001
CACHES = ("none", "prefix", "dual", "dllm", "d2cache")


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


def make_cache(name, batched: bool = False):
    """The cache with its defaults; in batches dLLM-Cache gets per-row schedules (its reference schedule is shared
    by the batch and stops when rows that sat steps out diverge)."""
    cls = cache_class(name)
    return cls(cls.Config(per_row_schedule=True) if batched and name == "dllm" else cls.Config())


def watch(cache, n_layers: int, fractions: list):
    """Record, for every call through ``cache``, the fraction of (position, layer) pairs it computed."""
    inner = cache.forward

    @contextmanager
    def forward(call):
        with inner(call) as c:
            yield c
        fractions.append(c.layer_positions / (c.batch_size * c.length * n_layers))

    cache.forward = forward
    return cache


def run(model, prompts, gen, strategy, conf, cache_name, device):
    cls = strategy_class(strategy)
    canvas = Canvas.from_prompts(prompts, gen, MASK, PAD, device=device)
    fractions: list = []
    cache = watch(make_cache(cache_name, len(prompts) > 1), model.config.n_layers, fractions)
    sync(device)
    t0, c0 = time.perf_counter(), time.process_time()
    decode(model, canvas, cls(cls.Config(**conf), gen), cache=cache)
    sync(device)
    return canvas, time.perf_counter() - t0, time.process_time() - c0, sum(fractions) / max(len(fractions), 1)


def random_part(args, device) -> None:
    model = build_model(args.d_model, args.layers, args.vocab, args.head_scale, device)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, MASK, (int(n),), generator=g).tolist() for n in args.prompt_lens.split(",")]
    print(f"(b) LLaDA-shaped random model: d_model {args.d_model}, {args.layers} layers, vocab {args.vocab}; "
          f"batch {len(prompts)} (prompts {args.prompt_lens}), block {args.block}, {args.reps} interleaved round(s), "
          f"device {device}" + (f" ({args.threads} threads)" if device.type == "cpu" else ""))
    head = (f"{'gen':>5} {'strategy':<15} {'cache':<8} {'NFE':>5} {'tok/s':>8} {'wall s':>7} {'speed-up':>8} "
            f"{'cpu s':>7} {'cpu x':>6} {'recomp':>7} {'agree':>6}")
    with torch.inference_mode():                                    # warm-up (kernels, allocator)
        for c in CACHES:
            run(model, prompts, args.block, "threshold", dict(threshold=args.threshold, block_length=args.block), c,
                device)
    for gen in [int(x) for x in str(args.gen).split(",")]:
        strategies = {
            "low_confidence": dict(steps=args.steps or gen // 2, block_length=args.block, loop="fastdllm"),
            "threshold": dict(threshold=args.threshold, block_length=args.block),
        }
        acc = {}
        for _ in range(args.reps):
            for name, conf in strategies.items():
                for cache in CACHES:
                    canvas, secs, cpu, frac = run(model, prompts, gen, name, conf, cache, device)
                    a = acc.setdefault((name, cache), dict(wall=0.0, cpu=0.0, frac=0.0))
                    a.update(wall=a["wall"] + secs, cpu=a["cpu"] + cpu, frac=a["frac"] + frac / args.reps,
                             nfe=canvas.nfe, toks=canvas.tokens[:, canvas.gen_start:].clone(), n=canvas.batch_size * gen)
        print(head)
        print("-" * len(head))
        for name in strategies:
            base = acc[(name, "none")]
            for cache in CACHES:
                a = acc[(name, cache)]
                agree = (a["toks"] == base["toks"]).float().mean().item()
                wall, cpu = a["wall"] / args.reps, a["cpu"] / args.reps
                print(f"{gen:>5} {name:<15} {cache:<8} {a['nfe']:>5} {a['n'] / wall:>8.1f} {wall:>7.2f} "
                      f"{base['wall'] / a['wall']:>7.2f}x {cpu:>7.2f} {base['cpu'] / a['cpu']:>5.2f}x "
                      f"{a['frac']:>7.1%} {agree:>6.1%}", flush=True)


def tasks_part(args) -> None:
    from dlm_engine.app import tasks
    from dlm_engine.app.api import load_directory, run_prompts
    from dlm_engine.checkpoints import embedded_path

    path = args.model_path or embedded_path()
    if path is None:
        print("(a) skipped: no embedded checkpoint (pass --model-path)")
        return
    lm = load_directory(path)
    examples = tasks.held_out(args.n)
    ids = [lm.encode(e.prompt) for e in examples]
    gen = tasks.ANSWER_LENGTH
    strategies = {
        "low_confidence": dict(steps=gen, block_length=8, loop="fastdllm"),
        "threshold": dict(threshold=0.9, block_length=8),
    }
    print(f"(a) embedded model {os.path.basename(str(path))}: {len(examples)} held-out prompts of the task mix, "
          f"generation {gen}, blocks of 8, batch {args.batch}" + (" (dllm: per-row schedules)" if args.batch > 1 else ""))
    head = f"{'strategy':<15} {'cache':<8} {'accuracy':>8} {'NFE/prompt':>10} {'TPS':>8}"
    print(head)
    print("-" * len(head))
    warm = strategy_class("threshold")
    run_prompts(lm, ids[:args.batch], lambda: warm(warm.Config(block_length=8), gen), lambda: make_cache("none"), gen,
                args.batch)                                     # warm-up (kernels, allocator)
    for name, conf in strategies.items():
        cls = strategy_class(name)
        for cache in CACHES:
            torch.manual_seed(0)
            stats = run_prompts(lm, ids, lambda: cls(cls.Config(**conf), gen), lambda: make_cache(cache, args.batch > 1),
                                gen, args.batch)
            ok = sum(tasks.check(e.task, e.prompt, r.text) for r, e in zip(stats.rows, examples))
            nfe = sum(r.nfe for r in stats.rows) / len(stats.rows)
            print(f"{name:<15} {cache:<8} {ok / len(examples):>8.1%} {nfe:>10.2f} {stats.tps:>8.0f}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=("both", "tasks", "random"), default="both")
    ap.add_argument("--n", type=int, default=300, help="(a) held-out prompts")
    ap.add_argument("--batch", type=int, default=64, help="(a) batch size")
    ap.add_argument("--model-path", default=None, help="(a) checkpoint directory (default: the embedded model)")
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--gen", default="256", help="(b) comma-separated generation lengths, e.g. 256,1024")
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--prompt-lens", default="40", help="(b) comma-separated prompt lengths (one batch, left-padded)")
    ap.add_argument("--steps", type=int, default=None, help="(b) low_confidence steps (default: gen / 2)")
    ap.add_argument("--threshold", type=float, default=0.9)
    ap.add_argument("--head-scale", type=float, default=15.0)
    ap.add_argument("--reps", type=int, default=1, help="(b) interleaved rounds")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    load_plugins()
    if args.part in ("both", "tasks"):
        tasks_part(args)
    if args.part in ("both", "random"):
        random_part(args, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
