"""What ``dlm`` does with a composed config: validate, load, decode, report, write results."""
from __future__ import annotations

import contextlib
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from omegaconf import DictConfig, OmegaConf

from dlm_engine.core.capabilities import incompatibility
from dlm_engine.errors import ConfigError

DEMO_PROMPTS = ["347+085=", "901-256=", "name a fruit:", "sum 9:"]


def build_strategy(cfg: DictConfig):
    from dlm_engine.core.registry import strategy_class

    cls = strategy_class(cfg.strategy.name)
    conf = OmegaConf.to_object(cfg.strategy)
    return lambda: cls(conf, cfg.gen_length)


def build_cache(cfg: DictConfig):
    from dlm_engine.core.registry import cache_class

    cls = cache_class(cfg.cache.name)
    conf = OmegaConf.to_object(cfg.cache)
    return lambda: cls(conf)


def pairing_caches(strategy) -> List[str]:
    """The registered caches that pair with ``strategy`` at their defaults (a refusal names them: a cache chosen by
    a model preset, e.g. ``model=tiny_bd`` -> ``block_kv``, is not on the user's command line)."""
    from dlm_engine.core.registry import CACHES

    return [name for name, cls in CACHES.items() if incompatibility(strategy, cls(cls.Config())) is None]


@dataclass
class Prepared:
    """What validating a run config resolved, handed to the run so that nothing is resolved twice: the strategy
    (built once; a strategy object serves every batch), the cache factory (a cache is per batch), the checkpoint
    directory (None: a seeded random model) and the prompts of ``prompts_file`` (read once; None without one)."""

    strategy: Any
    make_cache: Callable[[], Any]
    checkpoint: Optional[Path]
    file_prompts: Optional[list] = None


def prepare(cfg: DictConfig, schema=None) -> Prepared:
    """Every check that needs no model; raises ConfigError naming the key. ``schema``: the top level's dataclass
    when not ``dlm``'s RunConfig (``dlm-serve``)."""
    from dlm_engine.app.config import check_known_keys, check_values

    check_known_keys(cfg, schema)  # keys added with `+` that no schema has (a typo would be recorded, not applied)
    check_values(cfg)  # NaN/inf floats, integers beyond 64 bits, seed range
    if cfg.gen_length <= 0:
        raise ConfigError(f"gen_length={cfg.gen_length} must be a positive integer")
    if cfg.batch_size <= 0:
        raise ConfigError(f"batch_size={cfg.batch_size} must be a positive integer")
    if cfg.threads is not None and cfg.threads <= 0:
        raise ConfigError(f"threads={cfg.threads} must be a positive integer (or null: torch's default)")
    strategy = build_strategy(cfg)()  # runs the strategy's cross-field validation
    make_cache = build_cache(cfg)
    problem = incompatibility(strategy, make_cache())
    if problem is not None:
        raise ConfigError(f"{problem} (caches that pair with it: {', '.join(pairing_caches(strategy)) or 'none'})")
    from dlm_engine.models.chat import CHAT_MODES
    from dlm_engine.models.checkpoint import check_checkpoint

    if cfg.model.chat_template not in CHAT_MODES:
        raise ConfigError(f"model.chat_template='{cfg.model.chat_template}' (choose auto, on or off)")
    found = check_checkpoint(cfg.model)
    if found is not None and str(found) != str(cfg.model.path):  # a Hugging Face cache folder or snapshot
        cfg.model.path = str(found)
    file_prompts = None
    if cfg.prompts_file:
        from dlm_engine.app.inputs import read_prompts_file

        file_prompts = read_prompts_file(cfg.prompts_file)   # binary, not UTF-8, no prompts: one line
    _check_declared_length(cfg, found)
    from dlm_engine.models.loader import resolve_device, resolve_dtype

    resolve_dtype(cfg.dtype, resolve_device(cfg.device))
    from dlm_engine.app.recording import check_batch_size, check_config

    check_config(cfg.trace)
    check_batch_size(cfg, known_prompt_count(cfg, file_prompts))   # before the model loads
    return Prepared(strategy, make_cache, found, file_prompts)


def validate(cfg: DictConfig, schema=None):
    """:func:`prepare`, as the ``(make_strategy, make_cache)`` factories a decode takes."""
    p = prepare(cfg, schema)
    return (lambda: p.strategy), p.make_cache


def known_prompt_count(cfg: DictConfig, file_prompts: Optional[list] = None):
    """How many prompts ``dlm`` will decode, as far as the config tells without the model (None: not known);
    ``file_prompts``: the prompts file's prompts, already read."""
    if cfg.prompts is not None:
        return len(cfg.prompts)
    if cfg.prompts_file:
        if file_prompts is None:
            from dlm_engine.app.inputs import read_prompts_file

            file_prompts = read_prompts_file(cfg.prompts_file)
        return len(file_prompts)
    if cfg.task.name == "prompts":
        return len(DEMO_PROMPTS)
    return int(cfg.task.n) if cfg.task.n is not None else None


def _check_declared_length(cfg: DictConfig, found) -> None:
    """gen_length against the context length the model's config.json declares (before loading weights)."""
    import json

    from dlm_engine.app.inputs import check_gen_length, check_max_length

    override = check_max_length(cfg.model.get("max_length"))
    declared = None
    if found is not None and (Path(found) / "config.json").is_file():
        try:
            declared = json.loads((Path(found) / "config.json").read_text())
        except (OSError, ValueError):
            declared = None  # the loader reports a broken config.json with its own message
    elif cfg.model.get("random") is not None:
        declared = OmegaConf.to_container(cfg.model.random)
    if isinstance(declared, dict):
        check_gen_length(int(cfg.gen_length), declared, str(cfg.model.name), override)


def load_inputs(cfg: DictConfig, lm, file_prompts: Optional[list] = None) -> Dict[str, Any]:
    """Prompts (text and ids) plus the task examples when the task has a checker; every check that needs the
    model (context length, vocabulary, token ids in the strategy config) fails here, before decoding.
    ``file_prompts``: the prompts file's prompts when :func:`prepare` read them."""
    from dlm_engine.app import inputs as inp
    from dlm_engine.app import tasks as taskmod

    examples = None
    if cfg.prompts is not None:
        prompts = [_config_prompt(p, i) for i, p in enumerate(cfg.prompts)]
    elif cfg.prompts_file:
        prompts = file_prompts if file_prompts is not None else inp.read_prompts_file(cfg.prompts_file)
    elif cfg.task.name == "prompts":
        prompts = [inp.Prompt(text=p) for p in DEMO_PROMPTS]
    else:
        examples = taskmod.held_out_for(cfg.task)
        prompts = [inp.Prompt(text=e.prompt) for e in examples]
    if not prompts:
        raise ConfigError("prompts: no prompts to decode")
    prompts, ids, warning = inp.prepare(lm, prompts, int(cfg.gen_length), cfg)
    if warning:
        import sys

        print(f"dlm: warning: {warning}", file=sys.stderr)
    extra = [dict({"messages": p.messages} if p.messages else {}, **({"meta": p.meta} if p.meta else {}))
             for p in prompts]
    return {"prompts": [p.shown for p in prompts], "ids": ids, "examples": examples, "extra": extra}


def _config_prompt(p, i: int):
    """A ``prompts`` entry: a list is token ids (as in the Python API), an object a ``{prompt}``/``{messages}``
    prompt; any other value is text (``prompts=[1234]`` is the prompt "1234")."""
    from dlm_engine.app import inputs as inp
    from dlm_engine.errors import UserError

    if OmegaConf.is_config(p):
        try:
            return inp.as_prompt(OmegaConf.to_container(p, resolve=True))
        except UserError as exc:
            raise ConfigError(f"prompts[{i}]: {exc}") from None
    return inp.Prompt(text=str(p))


def run(cfg: DictConfig, out_dir: Path) -> Dict[str, Any]:
    import torch

    from dlm_engine.app.api import load_model, run_prompts
    from dlm_engine.app.sinks import ProgressSink

    prep = prepare(cfg)      # the checkpoint resolved, the prompts file read and the strategy built: once
    torch.manual_seed(cfg.seed)
    lm = load_model(cfg.model, cfg.device, cfg.dtype, checkpoint=prep.checkpoint)
    inputs = load_inputs(cfg, lm, prep.file_prompts)
    prompts, ids, examples = inputs["prompts"], inputs["ids"], inputs["examples"]
    progress = ProgressSink(len(ids), enabled=None if cfg.progress else False, log_interval=cfg.progress_interval,
                            start=start_line(cfg, len(ids), prep.strategy))

    torch.manual_seed(cfg.seed)
    from dlm_engine.app.recording import open_run_recorder

    recorder = open_run_recorder(cfg, out_dir, lm, ids)  # None when trace.record=false
    with recorder if recorder is not None else contextlib.nullcontext():  # closed (flushed) on errors and Ctrl-C too
        stats = run_prompts(lm, ids, prep.strategy, prep.make_cache, cfg.gen_length, cfg.batch_size,
                            sinks_for_batch=lambda b, rows: [progress] + ([recorder.sink(b, rows)] if recorder else []),
                            prompts=prompts, threads=cfg.threads, fast=cfg.fast)
    progress.close()

    correct = None
    for row, extra in zip(stats.rows, inputs["extra"]):
        row.extra.update(extra)
    if examples is not None:
        from dlm_engine.app.tasks import check

        for row, ex in zip(stats.rows, examples):
            row.extra["task"] = ex.task
            row.extra["correct"] = bool(check(ex.task, ex.prompt, row.text))
        correct = sum(r.extra["correct"] for r in stats.rows)
    rows = [{"index": r.index, "prompt": r.prompt, "text": r.text, "tokens": r.tokens, **r.metrics,
             "step_of": r.step_of, **r.extra}
            for r in stats.rows]
    summary = {
        "model": lm.name, "model_path": cfg.model.path or None, "model_digest": lm.digest, "chat_template": lm.chat_template,
        "strategy": OmegaConf.to_container(cfg.strategy),
        "cache": OmegaConf.to_container(cfg.cache), "gen_length": cfg.gen_length, "batch_size": cfg.batch_size,
        "seed": cfg.seed, "device": str(lm.device), "dtype": str(lm.dtype).replace("torch.", ""),
        "prompts": len(rows), **run_metrics(stats.totals),
        "versions": versions(),
        **({"trace": Path(recorder.path).name, "trace_digest": recorder.digest} if recorder else {}),
    }
    if correct is not None:
        summary["accuracy"] = correct / len(rows)
        summary["accuracy_by_task"] = accuracy_by_task(rows)
    write_outputs(out_dir, rows, summary)
    report(cfg, rows, summary, stats.totals)
    return summary


def start_line(cfg: DictConfig, n: int, strategy) -> str:
    """What a run decodes, said when it starts: prompts, the batch they run in, strategy (the preset picked) and
    cache."""
    batch = max(1, min(int(cfg.batch_size), n, strategy.max_batch or n))
    return (f"decoding {n} prompt{'s' if n != 1 else ''}, batch {batch}, strategy {strategy.label}, "
            f"cache {cfg.cache.name}, gen_length {cfg.gen_length}, model {cfg.model.name}")


def write_outputs(out_dir: Path, rows: List[dict], summary: Dict[str, Any]) -> None:
    """results.jsonl, then summary.json (the run's completion marker). If the second cannot be written (full
    disk), the first is removed too: a run directory never holds results that look complete without it."""
    from dlm_engine.fsutil import atomic_write_json, atomic_write_jsonl

    results = out_dir / "results.jsonl"
    atomic_write_jsonl(str(results), rows)
    try:
        atomic_write_json(str(out_dir / "summary.json"), summary)
    except BaseException:
        results.unlink(missing_ok=True)
        raise


def run_metrics(t) -> Dict[str, Any]:
    """The aggregate figures of summary.json / result.json (:mod:`dlm_engine.metrics`)."""
    from dlm_engine.metrics import METRICS_VERSION

    out = {"nfe": t.nfe, "nfe_per_prompt": t.nfe_per_sequence, "generated_tokens": t.generated_tokens,
           "tpf": t.tpf, "tps": t.tps, "latency_mean": t.latency_mean, "model_calls": t.model_calls,
           "wall_time": t.wall_time, "metrics_version": METRICS_VERSION}
    if getattr(t, "edits", 0) or getattr(t, "post_edit_nfe", 0):     # strategies that rewrite (edit)
        n = t.sequences or 1
        out.update(edits=t.edits, edits_per_prompt=t.edits / n, post_edit_nfe=t.post_edit_nfe,
                   post_edit_nfe_per_prompt=t.post_edit_nfe / n)
    return out


def accuracy_by_task(rows: List[dict]) -> Dict[str, float]:
    out: Dict[str, List[int]] = {}
    for r in rows:
        out.setdefault(r["task"], []).append(int(r["correct"]))
    return {k: sum(v) / len(v) for k, v in sorted(out.items())}


def versions() -> Dict[str, str]:
    import torch
    import transformers

    from dlm_engine import __version__

    return {"dlm_engine": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version()}


def report(cfg: DictConfig, rows: List[dict], summary: Dict[str, Any], totals) -> None:
    """The run's lines on the terminal and in the job's log (Hydra's job logging: cli.log)."""
    import logging

    from dlm_engine.metrics import summary_line
    from dlm_engine.app.jobs import in_multirun

    log = logging.getLogger("dlm_engine.run")
    show = cfg.print_outputs if cfg.print_outputs is not None else not in_multirun()
    if show:
        for r in rows[:200]:
            mark = "" if "correct" not in r else ("  ok" if r["correct"] else "  WRONG")
            log.info(f"[{r['index']}] {r['prompt']!r} -> {r['text']!r}  (nfe {r['nfe']}){mark}")
        if len(rows) > 200:
            log.info(f"... {len(rows) - 200} more rows in results.jsonl")
    line = summary_line(totals) + f"  wall {summary['wall_time']:.2f}s"
    if "accuracy" in summary:
        line = f"accuracy {summary['accuracy']:.3f}  " + line
    log.info(line)
