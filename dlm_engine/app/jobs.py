"""A ``dlm`` job's run directory: directory names from overrides, the config digest that decides resume, and the
per-job record. It belongs to the app (every ``dlm`` run is a job, a multirun's or alone); the sweep tools
read what it writes and import it, never the reverse.

:class:`JobRecord` is used by the ``dlm`` task function: it skips a multirun job whose ``result.json`` exists
(same resolved config), writes ``result.json`` atomically when the job finishes and ``error.json`` when it
fails. Aggregation lives in :mod:`dlm_engine.sweeps.cli` (scanning: :mod:`~dlm_engine.sweeps.scan`, tables:
:mod:`~dlm_engine.sweeps.tables`, plots: :mod:`~dlm_engine.sweeps.plots`).

The ``dlm_job_dir`` resolver (:func:`job_dirname`) is registered by ``dlm_engine.app.config.register_resolvers``
on ``import dlm_engine``, so launcher workers have it before they resolve ``hydra.sweep.subdir``.
"""
from __future__ import annotations

import hashlib
import json
import re
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

try:  # Hydra is a dependency; the fallback keeps this module importable without it
    from hydra.experimental.callback import Callback as _HydraCallback
except Exception:  # pragma: no cover
    _HydraCallback = object


RESULT = "result.json"
ERROR = "error.json"
VIZ_HINT = 'pip install "dlm-engine[viz]"'
# top-level keys that change neither the decoded output nor the metrics: left out of the job's directory
# name and of the config digest that decides whether an existing result.json still holds
NEUTRAL_KEYS = ("resume", "progress", "progress_interval", "print_outputs")
# ... and, with the name of a sweep preset (its parameters are overrides of their own), of job directory names
DIRNAME_EXCLUDE = NEUTRAL_KEYS + ("sweep",)
# top-level keys added after results were first written, with the value that decodes as before they existed: left
# out of the digest while they hold it, so that an upgrade does not make every finished job of a sweep run again
ADDED_KEYS = {"threads": None, "fast": True}
_UNSAFE = re.compile(r"[^A-Za-z0-9._,=+\-\[\]@:%]")
_MAX_DIRNAME = 120
MAX_PRINTED_ROWS = 40


# --------------------------------------------------------------------------------------- job directories
def job_dirname(overrides: Any = ()) -> str:
    """File-system-safe job directory name from a job's overrides (the resolver ``dlm_job_dir``).

    ``conf/hydra/output/dlm.yaml`` sets ``hydra.sweep.subdir: ${dlm_job_dir:${hydra.overrides.task}}``.
    Like Hydra's ``override_dirname``: the overrides sorted and joined by ``,``, here without the keys in
    :data:`DIRNAME_EXCLUDE`. Deterministic in the overrides, so re-running a sweep into the same
    ``hydra.sweep.dir`` finds each job's previous directory. Characters that are unsafe in a path (``/``,
    quotes, spaces, ...) become ``_``; names longer than 120 characters are cut and end in a hash of the
    full string. A job without overrides is ``default``. A plain string is only made safe.
    """
    if isinstance(overrides, str):
        s = overrides
    else:
        items = [str(o) for o in (overrides or ()) if split_override(str(o))[0] not in DIRNAME_EXCLUDE]
        s = ",".join(sorted(items))
    if not s:
        return "default"
    safe = _UNSAFE.sub("_", s)
    if len(safe) > _MAX_DIRNAME:
        safe = safe[:_MAX_DIRNAME - 11] + "-" + hashlib.sha1(s.encode()).hexdigest()[:10]
    return safe


# --------------------------------------------------------------------------------------- per-job records
def config_digest(cfg) -> Optional[str]:
    """sha256 of the resolved job config, without the keys in :data:`NEUTRAL_KEYS` (None if it does not
    resolve: the run itself then reports the problem)."""
    from omegaconf import OmegaConf

    try:
        c = OmegaConf.to_container(cfg, resolve=True)
    except Exception:
        return None
    for k in NEUTRAL_KEYS:
        c.pop(k, None)
    for k, v in ADDED_KEYS.items():
        if k in c and c[k] == v:
            del c[k]
    if isinstance(c.get("strategy"), dict):
        c["strategy"].pop("preset", None)   # a label (added later): results of pc_sampler & co. still hold
    return "sha256:" + hashlib.sha256(json.dumps(c, sort_keys=True, default=str).encode()).hexdigest()


def _hydra():
    try:
        from hydra.core.hydra_config import HydraConfig

        return HydraConfig.get() if HydraConfig.initialized() else None
    except Exception:  # pragma: no cover
        return None


def in_multirun() -> bool:
    hc = _hydra()
    if hc is None:
        return False
    from hydra.types import RunMode

    return hc.mode == RunMode.MULTIRUN


def launcher_target() -> str:
    """``hydra.launcher._target_`` of the running multirun job ('' outside a multirun)."""
    hc = _hydra()
    if hc is None or not in_multirun():
        return ""
    from omegaconf import OmegaConf

    return str(OmegaConf.select(hc, "launcher._target_", default="") or "")


def in_launcher_worker() -> bool:
    """True in a multirun job launched by a parallel or remote launcher (joblib, submitit, ...)."""
    target = launcher_target()
    return bool(target) and not target.endswith("BasicLauncher")


class JobRecord:
    """Bookkeeping of one ``dlm`` job: resume check, ``result.json`` / ``error.json``."""

    def __init__(self, cfg, out_dir: Path):
        from omegaconf import OmegaConf

        self.cfg = cfg
        self.out_dir = Path(out_dir)
        self.t0 = time.perf_counter()
        hc = _hydra()
        self.multirun = in_multirun()
        self.overrides: List[str] = [str(o) for o in hc.overrides.task] if hc is not None else []
        sel = (lambda key: OmegaConf.select(hc, key, default=None)) if hc is not None else (lambda key: None)
        self.job = {"name": sel("job.name"), "num": sel("job.num") if self.multirun else None,
                    "id": sel("job.id") if self.multirun else None,
                    "dir": str(self.out_dir)}
        self.digest = config_digest(cfg)

    @property
    def label(self) -> str:
        num = self.job.get("num")
        return (f"job {num}" if num is not None else "job") + f" ({self.out_dir.name})"

    def should_skip(self) -> bool:
        """Multirun resume: True (and says so) when this job's result.json exists for the same config."""
        path = self.out_dir / RESULT
        if not (self.multirun and path.is_file()):
            return False
        if not bool(self.cfg.get("resume", True)):
            print(f"dlm: {self.label}: resume=false, re-running (replacing {path})", flush=True)
            return False
        try:
            old = json.loads(path.read_text())
        except (OSError, ValueError):
            old = {}
        from dlm_engine.metrics import METRICS_VERSION

        if old.get("metrics_version") != METRICS_VERSION:
            print(f"dlm: {self.label}: {path} was written under older metric definitions, re-running", flush=True)
            return False
        if self.digest is not None and old.get("config_digest") == self.digest:
            print(f"dlm: {self.label}: skipped, result.json exists (resume=false re-runs it)", flush=True)
            return True
        print(f"dlm: {self.label}: the config changed since {path} was written, re-running", flush=True)
        return False

    def claim(self) -> bool:
        """One writer per job directory. True when this process now holds it; False (multirun: the job is
        skipped, saying who runs it) when another process does; a single run raises UserError naming the
        holder. Hold it until :meth:`release` (the kernel drops it if the process dies)."""
        from dlm_engine.errors import UserError
        from dlm_engine.fsutil import DirLock, os_error_message

        self.lock = DirLock(self.out_dir)
        try:
            if self.lock.acquire():
                return True
        except OSError as exc:   # a read-only, unwritable or full run directory
            raise UserError(os_error_message(exc, self.lock.path)) from None
        msg = f"{self.out_dir} is in use by {self.lock.holder()}"
        if self.multirun:
            print(f"dlm: {self.label}: skipped, {msg}", flush=True)
            return False
        raise UserError(f"run directory {msg}")

    def release(self) -> None:
        lock = getattr(self, "lock", None)
        if lock is not None:
            lock.release()

    def start(self) -> None:
        """Set the outputs of an earlier attempt aside (``.previous/``) before anything is written, so a crash
        now cannot leave a stale result, or an older run's complete files beside this run's partial ones."""
        from omegaconf import OmegaConf

        from dlm_engine.fsutil import set_aside

        trace = str(OmegaConf.select(self.cfg, "trace.filename", default="trace.dlmt"))
        set_aside(self.out_dir, [RESULT, ERROR, "summary.json", "results.jsonl", trace, trace + ".partial"])

    def finish(self, summary: Dict[str, Any]) -> Dict[str, Any]:
        from omegaconf import OmegaConf

        from dlm_engine.fsutil import atomic_write_json

        cfg = self.cfg
        from dlm_engine.metrics import METRICS_VERSION

        metrics = {k: summary.get(k) for k in ("accuracy", "nfe", "nfe_per_prompt", "tpf", "tps", "latency_mean",
                                               "model_calls", "wall_time", "generated_tokens", "prompts")
                   if k in summary}
        metrics["job_time"] = time.perf_counter() - self.t0
        if "accuracy_by_task" in summary:
            metrics["accuracy_by_task"] = summary["accuracy_by_task"]
        trace = summary.get("trace")
        if isinstance(trace, dict):
            trace = {"path": trace.get("path") or trace.get("file"), "digest": trace.get("digest")}
        elif trace:
            trace = {"path": str(trace), "digest": summary.get("trace_digest")}
        else:
            trace = None
        result = {
            "status": "ok",
            "metrics_version": METRICS_VERSION,
            "job": self.job,
            "overrides": self.overrides,
            "strategy": summary.get("strategy") or OmegaConf.to_container(cfg.strategy, resolve=True),
            "cache": summary.get("cache") or OmegaConf.to_container(cfg.cache, resolve=True),
            "model": summary.get("model"),
            "model_digest": summary.get("model_digest"),
            "task": str(cfg.task.name),
            "metrics": metrics,
            "versions": summary.get("versions"),
            "trace": trace,
            "config": {k: v for k, v in OmegaConf.to_container(cfg, resolve=True).items() if k not in NEUTRAL_KEYS},
            "config_digest": self.digest,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "host": _hostname(),
        }
        atomic_write_json(str(self.out_dir / RESULT), result)
        from dlm_engine.fsutil import drop_previous

        drop_previous(self.out_dir)
        return result

    def fail(self, exc: BaseException) -> None:
        """error.json for a failed multirun job (sweep.csv lists it; a re-run of the sweep retries it)."""
        from omegaconf import OmegaConf

        from dlm_engine.fsutil import atomic_write_json

        if not self.out_dir.is_dir():
            return
        try:
            config = {k: v for k, v in OmegaConf.to_container(self.cfg, resolve=True).items() if k not in NEUTRAL_KEYS}
        except Exception:  # an unresolvable config is itself a possible cause of the failure
            config = {}
        try:
            atomic_write_json(str(self.out_dir / ERROR), {
                "status": "failed", "job": self.job, "overrides": self.overrides,
                "error": str(exc), "error_type": type(exc).__name__,
                "strategy": config.get("strategy"), "cache": config.get("cache"),
                "model": (config.get("model") or {}).get("name"), "task": (config.get("task") or {}).get("name"),
                "config": config, "config_digest": self.digest,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": _hostname()})
        except OSError as werr:   # a full or read-only disk: say so, the job's failure is reported below
            from dlm_engine.fsutil import os_error_message

            print(f"dlm: {self.label}: cannot write {ERROR} ({os_error_message(werr)})", file=sys.stderr, flush=True)
        print(f"dlm: {self.label} failed: {exc}", file=sys.stderr, flush=True)


def _hostname() -> str:
    import socket

    try:
        return socket.gethostname()
    except OSError:  # pragma: no cover
        return ""


def split_override(ov: str) -> Tuple[str, str]:
    """``key=value`` of a Hydra override (``+``/``~`` prefixes dropped)."""
    key, _, val = ov.partition("=")
    return key.lstrip("+~"), val
