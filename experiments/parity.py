#!/usr/bin/env python3
"""Run every case of every suite file in a fixtures folder through dlm_engine; write a candidate file.

    python experiments/parity.py FIXTURES_DIR OUT.json [--only SUBSTRING]

FIXTURES_DIR holds suite files (``llada.json``, ``fastdllm_v2.json``, ...) in the reference-parity
format and a model directory (``tiny_llada/`` or ``tiny_dream/``). Each case runs at float32 on CPU
with ``torch.manual_seed(seed)`` right before decoding; the model is loaded through the normal
checkpoint loader. Cases dlm_engine cannot run yet are listed by id (never silently dropped).
Compare with ``python FIXTURES_DIR/compare.py FIXTURES_DIR OUT.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from dlm_engine.core.canvas import Canvas  # noqa: E402
from dlm_engine.core.loop import Sink, decode  # noqa: E402
from dlm_engine.models.loader import load_pretrained  # noqa: E402
from dlm_engine.core.registry import cache_class, load_plugins, strategy_class, STRATEGIES, CACHES  # noqa: E402

SKIP_FILES = {"manifest.json", "model_forward.json"}


class Unsupported(Exception):
    pass


class CallCounter(Sink):
    """Cumulative forward count after every step (to turn ``step_of`` into the fixtures' unmask_step)."""

    def __init__(self):
        self.cum = [0]
        self.scalars: List[dict] = []

    def on_delta(self, delta, canvas):
        self.cum.append(self.cum[-1] + delta.nfe)
        self.scalars.append(delta.scalars)


def _strategy_and_cache(case: dict) -> Tuple[str, dict, str]:
    """Map a reference function + kwargs onto (strategy name, strategy config overrides, cache name)."""
    fn, kw = case["function"], dict(case["kwargs"])
    kw.pop("mask_id", None)
    gen_length = kw.pop("gen_length", 128)
    suite = case["id"].split("/")[0]
    if suite in ("llada",):
        return "low_confidence", kw, "none", gen_length
    if suite == "fastdllm_v2":
        cache = {"generate": "none", "generate_with_prefix_cache": "prefix", "generate_with_dual_cache": "dual"}[fn]
        if kw.get("factor") is not None:
            kw.pop("threshold", None)
            return "factor", kw, cache, gen_length
        if kw.get("threshold") is not None:
            return "threshold", kw, cache, gen_length
        kw.pop("threshold", None)
        kw.pop("factor", None)
        kw["loop"] = "fastdllm"
        return "low_confidence", kw, cache, gen_length
    if suite == "cadllm":
        return "cadllm", kw, "dual", gen_length
    if suite == "prophet":
        return "early_exit", kw, "none", gen_length
    if suite.startswith("dream"):
        # Dream's diffusion_generate: generation length from max_new_tokens / max_length (specs/dream.md §3.1)
        kw.pop("attention_mask", None)
        cache = "none"
        if suite == "dream_block":                 # Fast-dLLM's block loop: block_length defaults to 32
            kw.setdefault("block_length", 32)
            cache = "dual" if kw.get("dual_cache") else "prefix"
        return "dream", dict(kw, function=fn), cache, _dream_gen_length(case)
    raise Unsupported(f"unknown suite '{suite}'")


def _dream_gen_length(case: dict) -> int:
    kw = case["kwargs"]
    ids = case.get("input_ids")
    P = case.get("prompt_len") or (len(ids[0]) if ids and isinstance(ids[0], list) else len(ids or []))
    if kw.get("max_new_tokens") is not None:
        return int(kw["max_new_tokens"])
    if kw.get("max_length") is not None:
        return int(kw["max_length"]) - P
    return min(20 + P, 256) - P   # DreamGenerationConfig's default max_length (tiny model: 256 positions)


def _rows(case: dict, prompts: List[List[int]]) -> Tuple[List[List[int]], bool]:
    """Prompt rows of a case (left padding removed; Canvas re-pads) and whether the case is batched."""
    extra = case.get("extra_inputs") or {}
    batch_idx = extra.get("batch")
    if "input_ids" in case:
        ids = case["input_ids"]
        batched = bool(ids) and isinstance(ids[0], list)
        rows = ids if batched else [ids]
        am = case.get("attention_mask")
        if am is not None:
            am = am if batched else [am]
            rows = [[t for t, a in zip(r, m) if a] for r, m in zip(rows, am)]
    else:
        rows = [prompts[i] for i in batch_idx] if batch_idx is not None else [prompts[case["prompt_idx"]]]
        if batch_idx is None and "prompt" in case:
            rows = [case["prompt"]]
        batched = batch_idx is not None
    n = int((case.get("kwargs") or {}).get("num_return_sequences") or 1)
    if n > 1:
        rows = [r for r in rows for _ in range(n)]
        batched = True
    return [list(r) for r in rows], batched


def build(case: dict):
    load_plugins()
    name, kw, cache_name, gen_length = _strategy_and_cache(case)
    if name not in STRATEGIES:
        raise Unsupported(f"strategy '{name}' is not implemented yet")
    if cache_name not in CACHES:
        raise Unsupported(f"cache '{cache_name}' is not implemented yet")
    cls = strategy_class(name)
    cfg_cls = cls.Config
    if hasattr(cls, "config_from_reference"):
        # optional context for strategies whose reference arguments are absolute canvas positions
        import inspect

        ctx = {"prompt_len": case.get("prompt_len"), "gen_length": gen_length}
        params = inspect.signature(cls.config_from_reference).parameters
        conf = cls.config_from_reference(kw, **{k: v for k, v in ctx.items() if k in params})
    else:
        fields = set(cfg_cls.__dataclass_fields__)
        unknown = sorted(set(kw) - fields)
        if unknown:
            raise Unsupported(f"strategy '{name}' has no options {unknown}")
        conf = cfg_cls(**kw)
    if cache_name not in cls.caches:
        raise Unsupported(f"strategy '{name}' does not support cache '{cache_name}'")
    return cls(conf, gen_length), cache_class(cache_name)(cache_class(cache_name).Config()), gen_length


def run_case(case: dict, prompts: List[List[int]], model, mask_id: int, pad_id: int) -> Dict[str, Any]:
    strategy, cache, gen_length = build(case)
    rows, batched = _rows(case, prompts)
    canvas = Canvas.from_prompts(rows, gen_length, mask_id, pad_id)
    if canvas.is_padded and not getattr(model, "logits_shift", 0):
        # The LLaDA references run Fast-dLLM's copy of the model, which ignores padding masks (spec §1.5):
        # left padding is attended like any token, with plain 0..L-1 positions. Reproduce that here.
        canvas.attention_mask[:] = True
        canvas.position_ids = torch.arange(canvas.length).expand(canvas.batch_size, -1).clone()
        canvas.is_padded = False
    if hasattr(strategy, "prepare_canvas"):
        strategy.prepare_canvas(canvas)
    counter = CallCounter()
    if case.get("seed") is not None:
        torch.manual_seed(case["seed"])
    decode(model, canvas, strategy, cache=cache, sinks=[counter])
    out = canvas.tokens.tolist()
    g = canvas.gen_start
    unmask = [[counter.cum[s] if s > 0 else 0 for s in so] for so in canvas.step_of[:, g:].tolist()]
    if not (batched and case["id"].startswith("dream")):   # the LLaDA suites record row 0 only
        unmask = unmask[0]
    res = {"id": case["id"], "output": out if batched else out[0], "nfe": canvas.nfe,
           "unmask_step": unmask}
    if hasattr(strategy, "reference_extra"):
        res["extra"] = strategy.reference_extra(counter.scalars, canvas)
    return res


def find_model_dir(folder: Path) -> Path:
    for name in ("tiny_llada", "tiny_dream"):
        if (folder / name / "config.json").is_file():
            return folder / name
    for sub in sorted(folder.iterdir()):
        if sub.is_dir() and (sub / "config.json").is_file():
            return sub
    raise SystemExit(f"parity: no model directory (with config.json) in {folder}")


def run_folder(folder: Path, only: Optional[str] = None, progress: bool = False) -> Tuple[List[dict], List[Tuple[str, str]]]:
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    model, raw, _ = load_pretrained(find_model_dir(folder), device="cpu", dtype="float32")
    mask_id = int(model.config.mask_token_id)
    pad_id = int(raw.get("pad_token_id") if raw.get("pad_token_id") is not None else raw.get("eos_token_id", 0))
    results, skipped = [], []
    for f in sorted(folder.glob("*.json")):
        if f.name in SKIP_FILES:
            continue
        suite = json.loads(f.read_text())
        for case in suite.get("cases", []):
            if only and only not in case["id"]:
                continue
            if "error" in case:
                skipped.append((case["id"], f"reference raised: {case['error']}"))
                continue
            try:
                results.append(run_case(case, suite["prompts"], model, mask_id, pad_id))
                if progress:
                    print(f"ran      {case['id']}", file=sys.stderr)
            except Unsupported as exc:
                skipped.append((case["id"], str(exc)))
    return results, skipped


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("fixtures", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--only", default=None, help="run only cases whose id contains this string")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    if not args.fixtures.is_dir():
        print(f"parity: fixtures folder '{args.fixtures}' does not exist", file=sys.stderr)
        return 2
    results, skipped = run_folder(args.fixtures, args.only, args.verbose)
    tmp = args.out.with_suffix(args.out.suffix + ".tmp")
    tmp.write_text(json.dumps({"cases": results}, indent=1))
    os.replace(tmp, args.out)
    for cid, why in skipped:
        print(f"not run  {cid}: {why}")
    print(f"parity: ran {len(results)} cases, {len(skipped)} not run; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
