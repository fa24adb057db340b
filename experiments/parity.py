#!/usr/bin/env python3
"""Run every case of every suite file in a fixtures folder through dlm_engine; write a candidate file.

    python experiments/parity.py FIXTURES_DIR OUT.json [--only SUBSTRING]

FIXTURES_DIR holds suite files (``llada.json``, ``fastdllm_v2.json``, ``dream.json``, ``d2c_*.json``, ...) in
the reference-parity format and the model directories they name (``tiny_llada/``, ``tiny_dream/``). Each
case runs at float32 on CPU with ``torch.manual_seed(seed)`` right before decoding; models are loaded
through the normal checkpoint loader. A case that fails to set up or run (a config error, a combination
dlm_engine cannot run, a runtime or model-loading error) is written as ``{"id", "error"}`` and listed by id; the
run goes on, and the exit status is 0 whatever single cases do (cases whose reference raised are listed as
not run). Compare with ``python tests/fixtures/compare.py FIXTURES_DIR OUT.json``.

The reference-only knowledge lives here, not in the strategies: each suite has an *adapter* that maps a
reference call (function + keyword arguments) onto a strategy config and a cache config, and turns the
decode's per-step scalars into the reference's extra outputs (CadLLM's vocabulary sizes, Prophet's exit
info).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from dlm_engine.core.canvas import Canvas  # noqa: E402
from dlm_engine.core.capabilities import incompatibility  # noqa: E402
from dlm_engine.core.loop import Sink, decode  # noqa: E402
from dlm_engine.core.registry import CACHES, STRATEGIES, cache_class, load_plugins, strategy_class  # noqa: E402
from dlm_engine.errors import UserError  # noqa: E402
from dlm_engine.models.loader import load_pretrained  # noqa: E402

SKIP_FILES = {"manifest.json", "model_forward.json"}
# suites whose reference-error cases are run (the port must refuse those settings) and whose failures are reported
# as the case's `error` in the candidate file
ERROR_SUITES = {"fdv2", "sdar", "llada2", "llada21"}


class Unsupported(Exception):
    pass


@dataclass
class Setup:
    """How one reference case runs in dlm_engine."""

    strategy: str
    config: Any                                # the strategy's config dataclass
    cache: str = "none"
    cache_config: Dict[str, Any] = field(default_factory=dict)
    gen_length: int = 128
    ignore_padding: bool = False               # the reference model attends to left padding (Fast-dLLM's copy)
    per_row: bool = False                      # batched cases record unmask_step per row (else row 0 only)
    eos_id: Optional[int] = None               # the EOS id the reference was given
    extra: Optional[Callable[[List[dict]], dict]] = None   # per-step scalars -> the reference's extra outputs
    canvas_gen: Optional[int] = None           # generated columns of the canvas when not gen_length (whole blocks)
    dtype: Optional[str] = None                # the model dtype the reference ran (bdparity's bfloat16 cases)
    events: bool = False                       # the fixtures record every write (``events``, by forward index)
    answer: Optional[Callable[[List[int], List[int], List[dict]], List[int]]] = None   # (prompt, canvas gen,
                                               # scalars) -> what the reference returned after the prompt
    output: Optional[Callable[[List[int], int], List[int]]] = None   # (row tokens, prompt length) -> returned row


class StepLog(Sink):
    """Cumulative forward count after every step (to turn ``step_of`` into the fixtures' unmask_step) and
    the strategy scalars of every decoding step (step 0, the set-up, is not a decoding step)."""

    def __init__(self):
        self.cum = {0: 0}
        self.scalars: List[dict] = []
        self.writes: List[List[List[int]]] = []     # per row: [step, generated position, token] (re-masks too)

    def on_start(self, canvas, info):
        self.writes = [[] for _ in range(canvas.batch_size)]

    def on_delta(self, delta, canvas):
        self.cum[delta.step] = self.cum.get(delta.step - 1, 0) + delta.nfe if delta.step > 0 else 0
        if delta.step <= 0:
            return
        self.scalars.append(delta.scalars)
        off = delta.start - canvas.gen_start
        remask = delta.remask if delta.remask is not None else torch.zeros_like(delta.commit)
        for r, (c_row, m_row, t_row) in enumerate(zip(delta.commit.tolist(), remask.tolist(), delta.tokens.tolist())):
            for j, (c, m, tok) in enumerate(zip(c_row, m_row, t_row)):
                if c or m:
                    self.writes[r].append([delta.step, off + j, tok if c else canvas.mask_id])


# -- adapters: reference call -> dlm_engine setup ----------------------------------------------------------
def _config(name: str, kw: dict):
    if name not in STRATEGIES:
        raise Unsupported(f"strategy '{name}' is not implemented yet")
    cls = strategy_class(name)
    unknown = sorted(set(kw) - set(cls.Config.__dataclass_fields__))
    if unknown:
        raise Unsupported(f"strategy '{name}' has no options {unknown}")
    return cls.Config(**kw)


def llada_setup(case: dict, suite: Optional[dict] = None) -> Setup:
    kw = dict(case["kwargs"])
    kw.pop("mask_id", None)
    gen = kw.pop("gen_length", 128)
    return Setup("low_confidence", _config("low_confidence", kw), gen_length=gen, ignore_padding=True)


def fastdllm_setup(case: dict, suite: Optional[dict] = None) -> Setup:
    kw = dict(case["kwargs"])
    kw.pop("mask_id", None)
    gen = kw.pop("gen_length", 128)
    cache = {"generate": "none", "generate_with_prefix_cache": "prefix", "generate_with_dual_cache": "dual"}[case["function"]]
    if kw.get("factor") is not None:
        kw.pop("threshold", None)
        name = "factor"
    elif kw.get("threshold") is not None:
        kw.pop("factor", None)
        name = "threshold"
    else:
        kw.pop("threshold", None)
        kw.pop("factor", None)
        kw["loop"] = "fastdllm"
        name = "low_confidence"
    return Setup(name, _config(name, kw), cache=cache, gen_length=gen, ignore_padding=True)


def cadllm_setup(case: dict, suite: Optional[dict] = None) -> Setup:
    kw = dict(case["kwargs"])
    kw.pop("mask_id", None)
    gen = kw.pop("gen_length", 128)

    def extra(scalars):
        return {"vocab_size_history": [int(s["vocab_size"]) for s in scalars if "vocab_size" in s]}

    return Setup("cadllm", _config("cadllm", kw), cache="dual", gen_length=gen, ignore_padding=True, extra=extra)


def prophet_setup(case: dict, suite: Optional[dict] = None) -> Setup:
    """Prophet's ``generate``: ``answer_start_pos`` is absolute (prompt + offset), thresholds come as a dict."""
    kw = dict(case["kwargs"])
    kw.pop("mask_id", None)
    gen = kw.pop("gen_length", 128)
    start = kw.pop("answer_start_pos", None)
    if not kw.pop("analyze_gap", False) or start is None:
        start = None
    else:  # an answer window outside the generation disables the test, as in the reference
        start = int(start) - int(case.get("prompt_len") or 0)
        if max(start, 0) >= min(start + kw.get("answer_length", 5), gen):
            start = None
    thr = dict(kw.pop("early_exit_thresholds", None) or {})
    cons = kw.pop("constraints", None)
    cons = [[int(p), int(t)] for p, t in (cons.items() if isinstance(cons, dict) else cons)] if cons else None
    conf = _config("early_exit", dict(kw, answer_start=start, constraints=cons, early_threshold=thr.get("early", 7.5),
                                      mid_threshold=thr.get("mid", 5.0), late_threshold=thr.get("late", 2.5)))
    steps = conf.steps if conf.steps is not None else gen

    def extra(scalars):
        fired = [i + 1 for i, sc in enumerate(scalars) if "exit" in sc and bool(sc["exit"][0])]
        return {"exit_info": {"early_exit_triggered": bool(fired), "exit_decision_step": fired[0] if fired else None,
                              "total_steps": steps, "actual_steps": len(scalars)}}

    return Setup("early_exit", conf, gen_length=gen, ignore_padding=True, extra=extra)


DREAM_IGNORED = ("max_new_tokens", "max_length", "output_history", "return_dict_in_generate", "return_dict",
                 "num_return_sequences", "mask_token_id", "pad_token_id", "bos_token_id", "eos_token_id",
                 "attention_mask", "function")


def dream_setup(case: dict, suite: Optional[dict] = None) -> Setup:
    """Dream's ``diffusion_generate`` (plus the runner's ``block_length``/``dual_cache`` for Fast-dLLM's loop)."""
    kw = {k: v for k, v in case["kwargs"].items() if k not in DREAM_IGNORED}
    block = case["id"].startswith("dream_block")
    if block:
        kw.setdefault("block_length", 32)
    dual = kw.pop("dual_cache", None)
    conf = _config("dream", dict(
        alg=kw.pop("alg", "origin"), steps=kw.pop("steps", 512), eps=kw.pop("eps", 1e-3),
        temperature=kw.pop("temperature", 0.0) or 0.0, top_p=kw.pop("top_p", None), top_k=kw.pop("top_k", None),
        alg_temp=kw.pop("alg_temp", None), threshold=kw.pop("threshold", 0.9),
        block_length=kw.pop("block_length", None), window="block" if dual else "rest", **kw))
    cache = ("dual" if dual else "prefix") if block else "none"
    return Setup("dream", conf, cache=cache, gen_length=_dream_gen_length(case))


def _dream_gen_length(case: dict) -> int:
    kw = case["kwargs"]
    ids = case.get("input_ids")
    P = case.get("prompt_len") or (len(ids[0]) if ids and isinstance(ids[0], list) else len(ids or []))
    if kw.get("max_new_tokens") is not None:
        return int(kw["max_new_tokens"])
    if kw.get("max_length") is not None:
        return int(kw["max_length"]) - P
    return min(20 + P, 256) - P   # DreamGenerationConfig's default max_length (tiny model: 256 positions)


D2C_STRATEGIES = {"vanilla": "d2c", "klass": "klass", "wino": "wino", "ar": "ar"}
D2C_IDS = ("mask_token_id", "pad_token_id", "eos_token_id")
# What a reference call gets for an argument it leaves out: the d2Cache framework's *code* defaults (spec
# d2cache.md §11, "code default" column), which differ from the project's defaults (its YAML's) where marked
D2C_CODE_DEFAULTS = {"block_length": 32}                   # generate(): ours is null = gen_length
D2C_WINO_CODE_DEFAULTS = {"wide_in_thres": 0.6}            # wino_generate(): ours is the yaml's 0.7
D2C_CACHE_CODE_DEFAULTS = {                                # cache_cls(**args): the class's constructor defaults
    "prefix": {}, "dual": {},
    "dllm": {"kp": 50, "kr": 2, "rou": 0.25},                               # dLLMCache: ours kr = 4 (fallback)
    "d2cache": {"rollout_p": 0.1, "current_k": 32, "sigma": 10.0, "inflate_w": 4},  # d2Cache: ours inflate_w = 0
}
_FREQ_FILES: Dict[Tuple[str, str], str] = {}


def d2c_freq_table(suite: dict, model: str) -> str:
    """The PC-Sampler counts the d2cparity harness used for the tiny models (ids < 1024), as a table file."""
    import tempfile

    key = (json.dumps(suite.get("token_freq", {}).get(model), sort_keys=True), model)
    if key not in _FREQ_FILES:
        tf = suite["token_freq"][model]
        fd, path = tempfile.mkstemp(prefix=f"d2c_freq_{model}_", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump({"num_token": tf["num_token"], "p_baseline_dict": tf["counts"]}, f)
        _FREQ_FILES[key] = path
    return _FREQ_FILES[key]


def d2c_setup(case: dict, suite: Optional[dict] = None) -> Setup:
    """The d2Cache framework's ``generate(model, ids, strategy=..., cache_cls=..., **kwargs)``."""
    kw = {k: v for k, v in case["kwargs"].items() if k not in D2C_IDS}
    name = D2C_STRATEGIES.get(kw.pop("strategy"))
    if name is None:
        raise Unsupported(f"d2Cache strategy '{case['kwargs']['strategy']}'")
    gen = kw.pop("gen_length", 128)
    kw = {**D2C_CODE_DEFAULTS, **(D2C_WINO_CODE_DEFAULTS if name == "wino" else {}), **kw}
    if kw.get("debias"):
        kw["freq_table"] = d2c_freq_table(suite or {}, case.get("model", "llada"))
    if name == "wino":
        kw["shrinking_window"] = True         # the reference's in-place block mask (the parity command's choice)
    cache, cache_config = "none", {}
    spec = case.get("cache")
    if spec:
        cache, cache_config = d2c_cache(spec)
    return Setup(name, _config(name, kw), cache=cache, cache_config=cache_config, gen_length=gen, per_row=True,
                 eos_id=case["kwargs"].get("eos_token_id"))


def d2c_cache(spec: dict) -> Tuple[str, dict]:
    """The cache of a ``cache_cls = partial(Class, **args)``: arguments left out take the class's code defaults."""
    name = spec.get("name")
    if name not in D2C_CACHE_CODE_DEFAULTS:
        raise Unsupported(f"d2Cache cache '{name}'")
    args = {**D2C_CACHE_CODE_DEFAULTS[name], **(spec.get("args") or {})}
    if name in ("prefix", "dual"):
        args.pop("use_dual", None)
        return name, dict(args, shifted="move")
    return name, args


def llada2_setup(case: dict, suite: Optional[dict] = None) -> Setup:
    """LLaDA2.0's ``generate``: the canvas is whole blocks from position 0 (``ceil((P + gen) / bl) * bl``); the
    reference returns the generation cut at ``gen_length`` and after its first EOS, or -- on an early EOS stop --
    up to that EOS (empty when it lies in the prompt)."""
    kw = dict(case["kwargs"])
    kw.pop("mask_id", None)
    eos = kw.pop("eos_id", None)
    gen = int(kw.pop("gen_length", 2048))
    P, bl = int(case["prompt_len"]), int(kw.get("block_length", 32))
    canvas_gen = -(-(P + gen) // bl) * bl - P

    def answer(prompt, canvas, scalars):
        stop = next((sc["stop"] for sc in scalars if "stop" in sc), None)
        if stop == "eos_prompt":
            return []
        out = canvas if stop == "eos_early_stop" else canvas[:gen]
        return out[:out.index(eos) + 1] if eos in out else out

    return Setup("llada2", _config("llada2", kw), gen_length=gen, canvas_gen=canvas_gen, eos_id=eos,
                 dtype=case.get("dtype"), events=True, answer=answer)


def llada21_setup(case: dict, suite: Optional[dict] = None) -> Setup:
    """LLaDA2.1's ``generate`` (the ``edit`` strategy): canvas and answer cut as LLaDA2.0's (no early return);
    ``steps`` and ``minimal_topk`` are computed and never used by the reference."""
    kw = dict(case["kwargs"])
    for k in ("mask_id", "steps", "minimal_topk"):
        kw.pop(k, None)
    eos = kw.pop("eos_id", None)
    gen = int(kw.pop("gen_length", 2048))
    P, bl = int(case["prompt_len"]), int(kw.get("block_length", 32))
    canvas_gen = -(-(P + gen) // bl) * bl - P

    def answer(prompt, canvas, scalars):
        out = canvas[:gen]
        return out[:out.index(eos) + 1] if eos in out else out

    return Setup("edit", _config("edit", kw), gen_length=gen, canvas_gen=canvas_gen, eos_id=eos,
                 dtype=case.get("dtype"), events=True, answer=answer)


SDAR_SAMPLERS = {"huggingface_bd3": "eval", "generate": "generate"}


def sdar_setup(case: dict, suite: Optional[dict] = None) -> Setup:
    """SDAR's two samplers (``huggingface_bd3.block_diffusion_generate`` and ``generate.py``'s): the canvas ends
    on the block boundary after ``P + gen_length``; the returned sequence is the whole canvas."""
    from dlm_engine.strategies.sdar import sdar_gen_length

    kw = dict(case["kwargs"])
    sampler = SDAR_SAMPLERS[case["id"].split("/")[1]]
    kw.pop("mask_id", None)
    gen = kw.pop("gen_length", 128)
    stop = kw.pop("stopping_criteria_idx", None)
    if sampler == "generate":
        kw["remasking"] = kw.pop("remasking_strategy", "low_confidence_dynamic")
        kw["threshold"] = kw.pop("confidence_threshold", 0.85)
        if kw.pop("eb_threshold", None) is not None:
            raise Unsupported("generate.py's eb_threshold (entropy_bounded crashes in the reference)")
    elif stop is None:
        raise Unsupported("the evaluation sampler needs stopping_criteria_idx (the reference raises TypeError)")
    conf = _config("sdar", dict(kw, sampler=sampler, stop_ids=[] if stop is None else list(stop)))
    P = int(case["prompt_len"])
    return Setup("sdar", conf, cache="block_kv", gen_length=sdar_gen_length(P, gen, conf.block_length), events=True)


def fdv2_setup(case: dict, suite: Optional[dict] = None) -> Setup:
    """Fast-dLLM v2's ``generate`` (one prompt): the canvas holds every block plus the last AR token; the
    returned row is cut after the first stop id."""
    from dlm_engine.strategies.fdv2 import fdv2_gen_length, fdv2_output

    if case["function"] == "batch_sample":
        return fdv2_batch_setup(case)
    kw = dict(case["kwargs"])
    kw.pop("mask_id", None)
    gen = kw.pop("max_new_tokens")
    conf = _config("fdv2", kw)
    P = int(case["prompt_len"])
    stop = int(conf.stop_token)
    return Setup("fdv2", conf, cache="block_kv", gen_length=fdv2_gen_length(P, gen, conf.block_size), events=True,
                 output=lambda row, g: fdv2_output(row, g, stop))


def fdv2_batch_setup(case: dict) -> Setup:
    """NVlabs' ``batch_sample``: right-padded rows from column 0 (``batch_canvas``); each row returns its own
    length (``row_ends``/``x_width`` scalars), ``unmask_step`` and events count from the row's own prompt end."""
    from dlm_engine.strategies.fdv2 import batch_gen_length

    kw = dict(case["kwargs"])
    for k in ("mask_id", "min_len", "seq_len"):
        kw.pop(k, None)
    pad = int(kw.pop("tokenizer")["pad_token_id"])
    seq = list(case["kwargs"]["seq_len"])
    conf = _config("fdv2_batch", dict(kw, pad_id=pad, right_padded=True, uncached_finish_error=True))
    return Setup("fdv2_batch", conf, cache="block_kv", per_row=True, events=True,
                 gen_length=batch_gen_length(seq, conf.max_new_tokens, conf.block_size))


ADAPTERS: Dict[str, Callable[[dict, Optional[dict]], Setup]] = {
    "llada2": llada2_setup, "llada21": llada21_setup,
    "sdar": sdar_setup, "fdv2": fdv2_setup,
    "llada": llada_setup, "fastdllm_v2": fastdllm_setup, "cadllm": cadllm_setup, "prophet": prophet_setup,
    "dream": dream_setup, "dream_block": dream_setup,
    **{s: d2c_setup for s in ("d2c_vanilla", "d2c_threshold", "d2c_factor", "d2c_pc", "d2c_eb", "d2c_klass",
                              "d2c_wino", "d2c_ar", "d2c_prefix", "d2c_dllm", "d2c_d2cache")},
}


def setup_for(case: dict, suite: Optional[dict] = None) -> Setup:
    load_plugins()
    name = case["id"].split("/")[0]
    adapter = ADAPTERS.get(name)
    if adapter is None:
        raise Unsupported(f"unknown suite '{name}'")
    return adapter(case, suite)


def build(case: dict, suite: Optional[dict] = None, overrides: Optional[dict] = None):
    """``(strategy, cache, setup)`` of a case (raises :class:`Unsupported` for what dlm_engine cannot run);
    ``overrides`` replace strategy config fields (e.g. to switch a reference quirk off)."""
    import dataclasses

    st = setup_for(case, suite)
    if overrides:
        st.config = dataclasses.replace(st.config, **overrides)
    if st.strategy not in STRATEGIES:
        raise Unsupported(f"strategy '{st.strategy}' is not implemented yet")
    if st.cache not in CACHES:
        raise Unsupported(f"cache '{st.cache}' is not implemented yet")
    strategy = strategy_class(st.strategy)(st.config, st.gen_length)
    ccls = cache_class(st.cache)
    unknown = sorted(set(st.cache_config) - set(ccls.Config.__dataclass_fields__))
    if unknown:
        raise Unsupported(f"cache '{st.cache}' has no options {unknown}")
    cache = ccls(ccls.Config(**st.cache_config))
    problem = incompatibility(strategy, cache)
    if problem is not None:
        raise Unsupported(problem)
    return strategy, cache, st


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


def run_case(case: dict, prompts: List[List[int]], model, mask_id: int, pad_id: int,
             suite: Optional[dict] = None, overrides: Optional[dict] = None) -> Dict[str, Any]:
    strategy, cache, st = build(case, suite, overrides)
    rows, batched = _rows(case, prompts)
    dev = next(model.parameters()).device
    if st.strategy == "fdv2_batch":
        return run_batch_sample(case, rows, model, mask_id, strategy, cache, st)
    gen = st.gen_length if st.canvas_gen is None else st.canvas_gen
    canvas = Canvas.from_prompts(rows, gen, mask_id, pad_id, device=dev, eos_id=st.eos_id)
    if canvas.is_padded and st.ignore_padding:
        # The LLaDA references run Fast-dLLM's copy of the model, which ignores padding masks (spec §1.5):
        # left padding is attended like any token, with plain 0..L-1 positions. Reproduce that here.
        canvas.attention_mask[:] = True
        canvas.position_ids = torch.arange(canvas.length, device=dev).expand(canvas.batch_size, -1).clone()
        canvas.is_padded = False
    log = StepLog()
    if case.get("seed") is not None:
        torch.manual_seed(case["seed"])
    decode(model, canvas, strategy, cache=cache, sinks=[log])
    out = canvas.tokens.tolist()
    g = canvas.gen_start
    unmask = [[log.cum[s] if s > 0 else 0 for s in so] for so in canvas.step_of[:, g:].tolist()]
    if st.output is not None:
        out = [st.output(row, g) for row in out]
        unmask = [u[:len(row) - g] for u, row in zip(unmask, out)]
    if not (batched and (st.per_row or case["id"].startswith("dream"))):   # the LLaDA suites record row 0 only
        unmask = unmask[0]
    res = {"id": case["id"], "output": out if batched else out[0], "nfe": canvas.nfe, "unmask_step": unmask}
    if st.strategy == "wino":              # every write, re-masks included (the fixtures' `events`)
        res["events"] = log.writes if batched else log.writes[0]
    if st.events:                          # every write (edits too), by the forward after which it happened
        ev = [[[log.cum[t], p, tok] for t, p, tok in row] for row in log.writes]
        res["events"] = ev if batched else ev[0]
    if st.answer is not None:
        ans = [st.answer(r, o[g:], log.scalars) for r, o in zip(rows, out)]
        res["output"] = [r + a for r, a in zip(rows, ans)] if batched else rows[0] + ans[0]
    if st.extra is not None:
        res["extra"] = st.extra(log.scalars)
    return res


def run_batch_sample(case: dict, rows: List[List[int]], model, mask_id: int, strategy, cache, st: Setup) -> dict:
    """A ``batch_sample`` case: rows of their own lengths (what the reference returns as a dict of rows)."""
    from dlm_engine.strategies.fdv2 import batch_canvas

    rows = [r[:n] for r, n in zip(case["input_ids"], case["kwargs"]["seq_len"])]
    canvas = batch_canvas(rows, st.gen_length, mask_id, device=next(model.parameters()).device)
    log = StepLog()
    if case.get("seed") is not None:
        torch.manual_seed(case["seed"])
    decode(model, canvas, strategy, cache=cache, sinks=[log])
    ends = [0] * canvas.batch_size
    width = canvas.length
    for sc in log.scalars:
        if "row_ends" in sc:
            ends = list(sc["row_ends"])
        if "x_width" in sc:
            width = int(sc["x_width"])
    ends = [e or width for e in ends]
    g = canvas.gen_start
    out, unmask, events = [], [], []
    for r, (toks, so) in enumerate(zip(canvas.tokens.tolist(), canvas.step_of.tolist())):
        n = len(rows[r])
        out.append(toks[:ends[r]])
        unmask.append([log.cum[s] if s > 0 else 0 for s in so[n:ends[r]]])
        events.append([[log.cum[w[0]], w[1] + g - n, w[2]] for w in log.writes[r]])
    return {"id": case["id"], "output": out, "nfe": canvas.nfe, "unmask_step": unmask, "events": events}


def model_dirs(folder: Path) -> Dict[str, Path]:
    """Model directories by name (``tiny_llada``, ``tiny_dream``, ...): the fixtures folder's own, else those
    of its sibling folders (the test copy of d2cparity shares refparity's and dreamparity's models)."""
    found: Dict[str, Path] = {}
    for root in [folder] + sorted(p for p in folder.resolve().parent.iterdir() if p.is_dir() and p != folder.resolve()):
        for sub in sorted(root.iterdir()):
            if sub.is_dir() and (sub / "config.json").is_file():
                found.setdefault(sub.name, sub)
        if root == folder and found:
            break
    if not found:
        raise SystemExit(f"parity: no model directory (with config.json) in {folder}")
    return found


def run_folder(folder: Path, only: Optional[str] = None, progress: bool = False, device: str = "cpu",
               dtype: str = "float32") -> Tuple[List[dict], List[Tuple[str, str]]]:
    """Every case of ``folder``'s suites (the fixtures were made on CPU in float32: on another device or dtype the
    count of matches is a measurement, not a pass)."""
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    dirs = model_dirs(folder)
    loaded: Dict[str, Tuple[Any, int, int]] = {}

    def model_for(case: dict, suite: dict):
        name = case.get("model_dir") or (suite.get("models") or {}).get(case.get("model")) or next(iter(dirs))
        if name not in dirs:
            raise Unsupported(f"no model directory '{name}' (found: {', '.join(sorted(dirs))})")
        # a case run by the reference in another dtype (bdparity's bfloat16 cases) loads the model so, unless the
        # whole run was asked in another dtype than the fixtures' float32
        dt = case.get("dtype") if dtype == "float32" and case.get("dtype") else dtype
        if (name, dt) not in loaded:
            try:
                model, raw, _ = load_pretrained(dirs[name], device=device, dtype=dt)
                pad = raw.get("pad_token_id") if raw.get("pad_token_id") is not None else raw.get("eos_token_id", 0)
                loaded[(name, dt)] = (model, int(model.config.mask_token_id), int(pad))
            except Exception as exc:        # every case of this model gets the same error (loaded once)
                loaded[(name, dt)] = exc
        if isinstance(loaded[(name, dt)], Exception):
            raise loaded[(name, dt)]
        model, mask_id, pad = loaded[(name, dt)]
        return model, mask_id, int(suite.get("pad_id", pad))

    results, skipped = [], []
    pc = folder / "d2c_pc.json"                     # the PC-Sampler counts every d2c suite's harness used
    token_freq = json.loads(pc.read_text()).get("token_freq") if pc.is_file() else None
    for f in sorted(folder.glob("*.json")):
        if f.name in SKIP_FILES:
            continue
        suite = json.loads(f.read_text())
        if token_freq is not None:
            suite.setdefault("token_freq", token_freq)
        own_errors = suite.get("suite") in ERROR_SUITES
        for case in suite.get("cases", []):
            if only and only not in case["id"]:
                continue
            if "error" in case and not own_errors:
                skipped.append((case["id"], f"reference raised: {case['error']}"))
                continue
            # (a suite without an adapter is reported before any model loads; a case the reference raised on, in a
            # suite whose settings the project refuses itself, runs and is recorded with the project's error)
            res = guarded(case["id"], lambda: (setup_for(case, suite),
                                               run_case(case, suite["prompts"], *model_for(case, suite), suite))[1])
            results.append(res)
            if progress:
                print(f"{'error' if 'error' in res else 'ran':8} {case['id']}", file=sys.stderr)
    return results, skipped


def guarded(case_id: str, run: Callable[[], Dict[str, Any]]) -> Dict[str, Any]:
    """``run()``'s candidate, or -- whatever it raised setting the case up or running it (a config error, an
    unsupported combination, a runtime or model-loading error) -- ``{"id", "error": "Type: message"}``: one bad
    case never stops the command. The message is made one line (torch's errors can span several)."""
    try:
        return run()
    except Exception as exc:
        return {"id": case_id, "error": " ".join(f"{type(exc).__name__}: {exc}".split())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("fixtures", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--only", default=None, help="run only cases whose id contains this string")
    ap.add_argument("-v", "--verbose", action="store_true")
    ap.add_argument("--device", default="cpu", help="cpu (the fixtures' device) or cuda")
    ap.add_argument("--dtype", default="float32", help="float32 (the fixtures' dtype) or bfloat16")
    args = ap.parse_args(argv)
    if not args.fixtures.is_dir():
        print(f"parity: fixtures folder '{args.fixtures}' does not exist", file=sys.stderr)
        return 2
    results, skipped = run_folder(args.fixtures, args.only, args.verbose, args.device, args.dtype)
    tmp = args.out.with_suffix(args.out.suffix + ".tmp")
    tmp.write_text(json.dumps({"cases": results}, indent=1))
    os.replace(tmp, args.out)
    errors = [r for r in results if "error" in r]
    for cid, why in skipped:
        print(f"not run  {cid}: {why}")
    for r in errors:
        print(f"error    {r['id']}: {r['error']}")
    print(f"parity: ran {len(results) - len(errors)} cases, {len(errors)} errors, {len(skipped)} not run; "
          f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
