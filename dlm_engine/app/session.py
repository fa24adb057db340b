"""Python API for notebooks and scripts: ``dlm_engine.generate(...)`` and :class:`Session`.

Both compose the same Hydra config as the ``dlm`` command (the packaged ``conf/``, the same schemas, presets,
defaults and checks: :func:`dlm_engine.app.compose.compose` + :func:`dlm_engine.app.run.validate`), so an
argument is spelled as the command-line override would be::

    import dlm_engine
    out = dlm_engine.generate(["123+456=", "name a fruit:"], strategy="threshold", cache="dual")
    out[0].text, out[0].metrics["nfe"], out.metrics["tpf"]

    s = dlm_engine.Session(model="tiny")          # loads the model once
    s.generate(["347+085="], strategy="low_confidence", gen_length=16, **{"strategy.steps": 8})

Defaults are ``dlm``'s (``conf/config.yaml``: ``strategy``, ``cache``, ``gen_length``, ``batch_size``, ...): an
argument left out is what the command line runs without it; ``strategy=None``/``cache=None`` keep the config's
choice (a strategy preset may pick its cache, as on the command line).

Keyword arguments are top-level keys (``gen_length=32``, ``batch_size=4``, ``seed=1``) or dotted keys
(``**{"strategy.threshold": 0.7}``); ``strategy``/``cache`` take a preset name or a dict of the preset name and
its options (``strategy={"name": "threshold", "threshold": 0.7}``); ``overrides=[...]`` takes raw override
strings. Bad values raise :class:`~dlm_engine.errors.ConfigError` with the one line ``dlm`` would print.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Union

from dlm_engine.errors import UserError

MODEL_KEYS = ("model", "device", "dtype")
# arguments whose None means the default of the composed config (conf/config.yaml: dlm's own)
DEFAULTED = ("strategy", "cache", "model", "device", "dtype")


def _is_model_key(key: str) -> bool:
    return key in MODEL_KEYS or key.startswith("model.")


def _group_overrides(group: str, value: Any) -> List[str]:
    from dlm_engine.app.compose import to_override

    if isinstance(value, dict):
        opts = dict(value)
        name = opts.pop("name", None)
        out = [to_override(group, name)] if name is not None else []
        return out + [to_override(f"{group}.{k}", v) for k, v in opts.items()]
    return [to_override(group, value)]


def _overrides(options: Dict[str, Any], extra: Iterable[str]) -> List[str]:
    from dlm_engine.app.compose import to_override

    out: List[str] = []
    for key, value in options.items():
        if key in DEFAULTED and value is None:      # the config's default (conf/config.yaml), not restated here
            continue
        if key in ("strategy", "cache", "model"):
            out += _group_overrides(key, value)
        else:
            out.append(to_override(key, value))
    return out + [str(o) for o in extra]


@dataclass
class Results:
    """What :meth:`Session.generate` returns: one :class:`~dlm_engine.app.api.RowResult` per prompt (``text``,
    ``tokens`` of the generation region, ``metrics``: NFE, generated tokens, TPF, latency, finish step), the
    aggregates (``metrics``: totals over sequences, model calls, TPS), the resolved config and the trace path."""

    rows: List[Any]
    totals: Any
    config: Any
    trace: Optional[str] = None

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self):
        return iter(self.rows)

    def __getitem__(self, i):
        return self.rows[i]

    @property
    def texts(self) -> List[str]:
        return [r.text for r in self.rows]

    @property
    def metrics(self) -> Dict[str, Any]:
        return self.totals.as_dict()

    def __repr__(self) -> str:
        from dlm_engine.metrics import summary_line

        return f"<Results {summary_line(self.totals)}>"


class Session:
    """A model loaded once, decoded with any strategy and cache: ``Session()`` (``dlm``'s default model, device
    and dtype) or ``Session(model="local", **{"model.path": DIR}, device="cuda")``. Model keys (``model``, ``model.*``,
    ``device``, ``dtype``) are fixed here; everything else is chosen per :meth:`generate` call."""

    def __init__(self, model: Union[str, Dict[str, Any], None] = None, device: Optional[str] = None,
                 dtype: Optional[str] = None,
                 **model_options: Any):
        bad = sorted(k for k in model_options if not _is_model_key(k))
        if bad:
            raise UserError(f"Session takes model options only (model.*, device, dtype); pass {', '.join(bad)} "
                            "to generate()")
        self.model, self.device, self.dtype, self.options = model, device, dtype, dict(model_options)
        self._lm = None

    @property
    def key(self):
        return (repr(self.model), self.device, self.dtype, repr(sorted(self.options.items())))

    def __repr__(self) -> str:
        return f"<Session model={self.model!r} device={self.device} dtype={self.dtype} loaded={self._lm is not None}>"

    def _model_overrides(self) -> List[str]:
        return _overrides({"model": self.model, "device": self.device, "dtype": self.dtype, **self.options}, ())

    def config(self, strategy: Any = None, cache: Any = None, overrides: Iterable[str] = (), **options: Any):
        """The validated run config of a :meth:`generate` call (nothing is loaded)."""
        return self._prepare(strategy, cache, overrides, **options)[0]

    def _prepare(self, strategy: Any = None, cache: Any = None, overrides: Iterable[str] = (), **options: Any):
        """``(config, prepared)``: the composed config and what validating it resolved and built
        (:class:`dlm_engine.app.run.Prepared`)."""
        from dlm_engine.app.compose import compose
        from dlm_engine.app.run import prepare

        bad = sorted(k for k in options if _is_model_key(k))
        if bad:
            raise UserError(f"{', '.join(bad)}: model options are fixed when the Session is created "
                            "(create another Session for another model)")
        options = {"strategy": strategy, "cache": cache, "progress": False, "print_outputs": False,
                   "trace.record": False, **options}
        cfg = compose(self._model_overrides() + _overrides(options, overrides))
        return cfg, prepare(cfg)

    @property
    def lm(self):
        """The loaded model (:class:`~dlm_engine.app.api.LoadedModel`), loaded on first use."""
        if self._lm is None:
            from dlm_engine.app.api import load_model

            cfg, prep = self._prepare()
            self._lm = load_model(cfg.model, cfg.device, cfg.dtype, checkpoint=prep.checkpoint)
        return self._lm

    def generate(self, prompts: Sequence[Any], strategy: Any = None, cache: Any = None, *,
                 trace: Optional[Union[str, os.PathLike]] = None, overrides: Iterable[str] = (),
                 **options: Any) -> Results:
        """Decode ``prompts`` (strings, token-id lists, ``{"prompt": ...}`` or ``{"messages": [...]}``) and
        return per-sequence results; ``trace=PATH`` records a trace file there (``dlm-trace`` reads it)."""
        import contextlib

        import torch

        from dlm_engine.app import inputs as inp
        from dlm_engine.app.api import run_prompts

        prompts = _prompt_list(prompts)
        if not len(prompts):
            raise UserError("prompts: no prompts to decode")
        if trace is not None:
            path = Path(trace).expanduser()
            if path.is_dir() or not path.parent.is_dir():
                raise UserError(f"trace: '{trace}' must be a file in an existing directory")
            options = dict(options, **{"trace.record": True, "trace.filename": path.name})
        cfg, prep = self._prepare(strategy, cache, overrides, **options)
        if self._lm is None:      # the model options are the Session's: this call's config names its model
            from dlm_engine.app.api import load_model

            self._lm = load_model(cfg.model, cfg.device, cfg.dtype, checkpoint=prep.checkpoint)
        lm = self._lm
        items, ids, warning = inp.prepare(lm, prompts, int(cfg.gen_length), cfg)
        if warning:
            import warnings

            warnings.warn(warning, UserWarning, stacklevel=2)
        # seeded before the recorder opens: its header keeps the RNG state the decode starts from (what
        # `dlm-trace verify --rerun` restores), as `dlm` does
        torch.manual_seed(int(cfg.seed))
        recorder = None
        if trace is not None:
            from dlm_engine.app.recording import open_run_recorder

            recorder = open_run_recorder(cfg, path.parent, lm, ids)
        with recorder if recorder is not None else contextlib.nullcontext():
            stats = run_prompts(lm, ids, prep.strategy, prep.make_cache, int(cfg.gen_length),
                                int(cfg.batch_size), prompts=[p.shown for p in items],
                                sinks_for_batch=(lambda b, rows: [recorder.sink(b, rows)]) if recorder else None,
                                threads=cfg.threads, fast=cfg.fast)
        for row, p in zip(stats.rows, items):
            if p.messages:
                row.extra["messages"] = p.messages
            if p.meta:
                row.extra["meta"] = p.meta
        return Results(rows=stats.rows, totals=stats.totals, config=cfg,
                       trace=str(recorder.written_path) if recorder else None)


def _prompt_list(prompts: Any) -> List[Any]:
    """``prompts`` as a list: one prompt (a string or an object) or a collection of them; anything else (None, a
    number, bytes) is the UserError other bad prompts get."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if hasattr(prompts, "tolist") and not isinstance(prompts, (list, tuple)):   # a tensor / array of token ids
        prompts = prompts.tolist()
    if isinstance(prompts, (bytes, bytearray)) or not isinstance(prompts, Iterable):
        raise UserError("prompts: expected a prompt or a list of prompts (strings, token-id lists, {\"prompt\": ...} "
                        f"or {{\"messages\": [...]}}), got {type(prompts).__name__}")
    return list(prompts)


_default: Optional[Session] = None


def generate(prompts: Sequence[Any], strategy: Any = None, cache: Any = None, model: Any = None, *,
             trace: Optional[Union[str, os.PathLike]] = None, overrides: Iterable[str] = (), **options: Any) -> Results:
    """Decode ``prompts`` with a strategy and cache on a model (preset names as on the ``dlm`` command line;
    None, the default: the one ``dlm`` runs, from ``conf/config.yaml``).

    The model stays loaded for the next call with the same model options (``model``, ``model.*``, ``device``,
    ``dtype``); :class:`Session` gives explicit control. See :meth:`Session.generate`.
    """
    global _default
    model_opts = {k: v for k, v in options.items() if _is_model_key(k)}
    rest = {k: v for k, v in options.items() if not _is_model_key(k)}
    wanted = Session(model, **model_opts)
    if _default is None or _default.key != wanted.key:
        _default = wanted
    return _default.generate(prompts, strategy, cache, trace=trace, overrides=overrides, **rest)
