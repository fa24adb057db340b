#!/usr/bin/env python3
"""Checkpoint loading: wall time and peak host memory for a synthetic sharded bf16 LLaDA checkpoint.

    python experiments/bench_load.py [--dir /tmp/dlm_bench_ckpt] [--layers 12] [--shards 4] [--dtype float32]

The checkpoint (official names, ``model.safetensors.index.json`` + shards, bf16 like the released 8B models) is
written once; each load then runs in a fresh process so ``ru_maxrss`` is that load's peak. Printed: load time,
peak RSS, the loaded weights' size, and peak RSS minus the interpreter's baseline (torch imported).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

CHILD = r"""
import os, resource, sys, time
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch
from dlm_engine.models.loader import load_pretrained
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
t = time.perf_counter()
model, raw, digest = load_pretrained(sys.argv[1], "cpu", sys.argv[2])
dt = time.perf_counter() - t
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
size = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
print(f"{dt:.2f} {peak:.0f} {size:.0f} {peak - base:.0f}")
"""


def make(d: Path, layers: int, shards: int) -> None:
    import torch
    from safetensors.torch import save_file

    from dlm_engine.models.loader import build_random

    cfg = dict(model_type="llada", d_model=1024, n_heads=16, n_kv_heads=16, n_layers=layers, mlp_hidden_size=4096,
               vocab_size=32000, embedding_size=32000, max_sequence_length=512, rope_theta=10000.0,
               mask_token_id=3, eos_token_id=2, pad_token_id=0, weight_tying=False)
    model = build_random(cfg, seed=0)[0]
    sd = {k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    keys = sorted(sd)
    per = -(-len(keys) // shards)
    d.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: sd[k] for k in keys[i * per:(i + 1) * per]}
        save_file(part, str(d / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in part})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (d / "config.json").write_text(json.dumps(dict(cfg, architectures=["LLaDAModelLM"])))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/dlm_bench_ckpt")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--dtype", default="float32,bfloat16")
    args = ap.parse_args()
    d = Path(args.dir)
    if not (d / "config.json").is_file():
        make(d, args.layers, args.shards)
    on_disk = sum(f.stat().st_size for f in d.glob("*.safetensors")) / 2**20
    print(f"checkpoint: {d} ({on_disk:.0f} MB bf16 in {args.shards} shards)")
    print("| load dtype | seconds | peak RSS MB | weights MB | peak above baseline MB |")
    print("|---|---|---|---|---|")
    for dtype in args.dtype.split(","):
        out = subprocess.run([sys.executable, "-c", CHILD, str(d), dtype], capture_output=True, text=True, check=True)
        secs, peak, size, above = out.stdout.split()
        print(f"| {dtype} | {secs} | {peak} | {size} | {above} |")


if __name__ == "__main__":
    main()
