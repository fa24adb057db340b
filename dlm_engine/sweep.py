"""Hydra multirun support: per-job ``result.json``, idempotent resume, sweep tables and plots.

* :class:`JobRecord` is used by the ``dlm`` task function: it skips a multirun job whose ``result.json``
  exists (same resolved config), writes ``result.json`` atomically when the job finishes and
  ``error.json`` when it fails.
* :func:`aggregate` scans a sweep directory for ``result.json`` / ``error.json`` files (nothing is kept in
  memory between jobs) and writes ``sweep.csv``, ``sweep.md`` and, with matplotlib, ``accuracy_vs_nfe.png``
  and ``tps.png``. It runs at the end of a multirun (:class:`AggregateCallback`, configured in
  ``conf/hydra/callbacks/sweep.yaml``) and as the ``dlm-sweep DIR`` command, for partial or failed sweeps.

The ``dlm_job_dir`` resolver (:func:`job_dirname`) is registered by ``dlm_engine.config.register_resolvers``
on ``import dlm_engine``, so launcher workers have it before they resolve ``hydra.sweep.subdir``.
"""
from __future__ import annotations

import csv
import hashlib
import io
import json
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

try:  # Hydra is a dependency; the fallback keeps this module importable without it
    from hydra.experimental.callback import Callback as _HydraCallback
except Exception:  # pragma: no cover
    _HydraCallback = object


RESULT = "result.json"
ERROR = "error.json"
VIZ_HINT = 'pip install "dlm-engine[viz]"'
# top-level keys that change neither the decoded output nor the metrics: left out of the job's directory
# name and of the config digest that decides whether an existing result.json still holds
NEUTRAL_KEYS = ("resume", "progress", "print_outputs")
# ... and, with the name of a sweep preset (its parameters are overrides of their own), of job directory names
DIRNAME_EXCLUDE = NEUTRAL_KEYS + ("sweep",)
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
        items = [str(o) for o in (overrides or ()) if _split_override(str(o))[0] not in DIRNAME_EXCLUDE]
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


def in_launcher_worker() -> bool:
    """True in a multirun job launched by a parallel or remote launcher (joblib, submitit, ...)."""
    hc = _hydra()
    if hc is None or not in_multirun():
        return False
    from omegaconf import OmegaConf

    target = str(OmegaConf.select(hc, "launcher._target_", default="") or "")
    return not target.endswith("BasicLauncher")


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
        if self.digest is not None and old.get("config_digest") == self.digest:
            print(f"dlm: {self.label}: skipped, result.json exists (resume=false re-runs it)", flush=True)
            return True
        print(f"dlm: {self.label}: the config changed since {path} was written, re-running", flush=True)
        return False

    def start(self) -> None:
        """Remove the outcome of an earlier attempt so a crash now cannot leave a stale result behind."""
        for name in (RESULT, ERROR):
            try:
                (self.out_dir / name).unlink()
            except FileNotFoundError:
                pass

    def finish(self, summary: Dict[str, Any]) -> Dict[str, Any]:
        from omegaconf import OmegaConf

        from .fsutil import atomic_write_json

        cfg = self.cfg
        metrics = {k: summary.get(k) for k in ("accuracy", "nfe", "nfe_per_prompt", "tpf", "tps", "wall_time",
                                               "generated_tokens", "prompts") if k in summary}
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
        return result

    def fail(self, exc: BaseException) -> None:
        """error.json for a failed multirun job (sweep.csv lists it; a re-run of the sweep retries it)."""
        from omegaconf import OmegaConf

        from .fsutil import atomic_write_json

        if not self.out_dir.is_dir():
            return
        try:
            config = {k: v for k, v in OmegaConf.to_container(self.cfg, resolve=True).items() if k not in NEUTRAL_KEYS}
        except Exception:  # an unresolvable config is itself a possible cause of the failure
            config = {}
        atomic_write_json(str(self.out_dir / ERROR), {
            "status": "failed", "job": self.job, "overrides": self.overrides,
            "error": str(exc), "error_type": type(exc).__name__,
            "strategy": config.get("strategy"), "cache": config.get("cache"),
            "model": (config.get("model") or {}).get("name"), "task": (config.get("task") or {}).get("name"),
            "config": config, "config_digest": self.digest,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": _hostname()})
        print(f"dlm: {self.label} failed: {exc}", file=sys.stderr, flush=True)


def _hostname() -> str:
    import socket

    try:
        return socket.gethostname()
    except OSError:  # pragma: no cover
        return ""


# --------------------------------------------------------------------------------------- scanning
def scan(root: Path) -> List[Dict[str, Any]]:
    """Every job under ``root``: ``result.json`` (ok), ``error.json`` (failed), or a Hydra job directory
    with neither (incomplete: running, killed or not started). Hidden directories are not entered."""
    root = Path(root)
    jobs = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        d = Path(dirpath)
        rel = d.relative_to(root).as_posix() if d != root else "."
        record = None
        for name in (RESULT, ERROR):
            if name in filenames:
                try:
                    record = json.loads((d / name).read_text())
                    break
                except (OSError, ValueError) as exc:
                    record = {"status": "unreadable", "error": f"{name}: {exc}"}
        if record is None and (d / ".hydra" / "overrides.yaml").is_file():
            record = {"status": "incomplete", "overrides": _read_overrides(d / ".hydra" / "overrides.yaml")}
            config = _read_yaml(d / ".hydra" / "config.yaml")
            if isinstance(config, dict):
                record.update(config=config, strategy=config.get("strategy"), cache=config.get("cache"),
                              model=(config.get("model") or {}).get("name"))
        if record is not None:
            record.setdefault("overrides", _read_overrides(d / ".hydra" / "overrides.yaml"))
            record["_dir"] = rel
            jobs.append(record)
    return jobs


def _read_yaml(path: Path) -> Any:
    try:
        import yaml

        return yaml.safe_load(path.read_text())
    except Exception:
        return None


def _read_overrides(path: Path) -> List[str]:
    data = _read_yaml(path)
    return [str(x) for x in data] if isinstance(data, list) else []


# --------------------------------------------------------------------------------------- table
# result.json metric -> sweep.csv column ("prompts" is also a config key, hence n_prompts)
METRICS = {"accuracy": "accuracy", "nfe_per_prompt": "nfe_per_prompt", "nfe": "nfe", "tpf": "tpf", "tps": "tps",
           "wall_time": "wall_time", "job_time": "job_time", "generated_tokens": "generated_tokens",
           "prompts": "n_prompts"}
SKIP_OVERRIDE_KEYS = {"sweep"} | set(NEUTRAL_KEYS)
RESERVED = {"job", "status", "pareto", "trace_path", "trace_digest", "error", *METRICS.values()}


def _parse_scalar(text: str) -> Any:
    t = text.strip()
    low = t.lower()
    if low in ("null", "none", "~"):
        return None
    if low in ("true", "false"):
        return low == "true"
    try:
        return int(t)
    except ValueError:
        pass
    try:
        return float(t)
    except ValueError:
        return t.strip("'\"")


def _split_override(ov: str) -> Tuple[str, str]:
    key, _, val = ov.partition("=")
    return key.lstrip("+~"), val


def _select(container: Any, dotted: str) -> Tuple[bool, Any]:
    cur = container
    for part in dotted.split("."):
        if isinstance(cur, dict) and part in cur:
            cur = cur[part]
        else:
            return False, None
    return True, cur


def _cell(v: Any) -> Any:
    if isinstance(v, (list, dict)):
        return json.dumps(v)
    return v


def rows_from_jobs(jobs: Sequence[Dict[str, Any]]) -> Tuple[List[Dict[str, Any]], List[str], List[str], List[str]]:
    """Flatten job records into table rows.

    Returns (rows, setting columns, metric columns, swept columns): settings are the resolved strategy and
    cache fields, the model and every override key; swept columns are the settings some job overrides
    (listed first; the printed table and the plots use those that vary).
    """
    rows = []
    setting_cols: List[str] = ["strategy", "cache", "model"]
    swept: List[str] = []
    task_cols: List[str] = []
    for job in jobs:
        row: Dict[str, Any] = {"job": job.get("_dir"), "status": job.get("status", "ok")}
        settings: Dict[str, Any] = {}
        strat = job.get("strategy") if isinstance(job.get("strategy"), dict) else {}
        cache = job.get("cache") if isinstance(job.get("cache"), dict) else {}
        if strat:
            settings["strategy"] = strat.get("name")
            settings.update({f"strategy.{k}": v for k, v in strat.items() if k != "name"})
        if cache:
            settings["cache"] = cache.get("name")
            settings.update({f"cache.{k}": v for k, v in cache.items() if k != "name"})
        if job.get("model") is not None:
            settings["model"] = job.get("model")
        config = job.get("config") or {}
        for ov in job.get("overrides") or []:
            key, val = _split_override(ov)
            if key.startswith("hydra") or key in SKIP_OVERRIDE_KEYS or key in RESERVED:
                continue
            if key not in swept:
                swept.append(key)
            if key in settings:
                continue
            found, value = _select(config, key)
            if found and isinstance(value, dict) and "name" in value:  # a group choice: its name
                value = value["name"]
            settings[key] = _cell(value) if found else _parse_scalar(val)
        for k in settings:
            if k not in setting_cols:
                setting_cols.append(k)
        row.update(settings)
        m = job.get("metrics") or {}
        for k, col in METRICS.items():
            row[col] = m.get(k)
        for task, acc in (m.get("accuracy_by_task") or {}).items():
            col = f"accuracy.{task}"
            row[col] = acc
            if col not in task_cols:
                task_cols.append(col)
        trace = job.get("trace") or {}
        row["trace_path"] = trace.get("path") if isinstance(trace, dict) else trace
        row["trace_digest"] = trace.get("digest") if isinstance(trace, dict) else None
        row["error"] = job.get("error")
        rows.append(row)
    mark_pareto(rows)
    setting_cols = [c for c in setting_cols if any(c in r for r in rows)]
    swept = [c for c in setting_cols if c in swept]
    setting_cols = swept + [c for c in setting_cols if c not in swept]
    rows.sort(key=lambda r: tuple(_sort_key(r.get(c)) for c in setting_cols) + (_sort_key(r["job"]),))
    metric_cols = list(METRICS.values()) + ["pareto"] + sorted(task_cols) + ["trace_path", "trace_digest", "error"]
    return rows, setting_cols, metric_cols, swept


def _sort_key(v: Any) -> Tuple[int, Any]:
    if v is None:
        return (3, "")
    if isinstance(v, bool):
        return (0, float(v))
    if isinstance(v, (int, float)):
        return (0, float(v))
    return (1, str(v))


def mark_pareto(rows: List[Dict[str, Any]]) -> None:
    """``pareto`` = no other finished job has accuracy >= and NFE per prompt <=, one of them strictly."""
    pts = [(i, r["accuracy"], r["nfe_per_prompt"]) for i, r in enumerate(rows)
           if r.get("status") == "ok" and _num(r.get("accuracy")) and _num(r.get("nfe_per_prompt"))]
    for r in rows:
        r["pareto"] = None
    for i, acc, nfe in pts:
        dominated = any(a >= acc and n <= nfe and (a > acc or n < nfe) for j, a, n in pts if j != i)
        rows[i]["pareto"] = not dominated


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def varying(rows: Sequence[Dict[str, Any]], cols: Sequence[str]) -> List[str]:
    """The columns whose value is not the same in every row."""
    out = []
    for c in cols:
        vals = {json.dumps(r.get(c), sort_keys=True, default=str) for r in rows}
        if len(vals) > 1:
            out.append(c)
    return out


def write_csv(path: Path, rows: Sequence[Dict[str, Any]], cols: Sequence[str]) -> None:
    from .fsutil import atomic_write_bytes

    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(cols), extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({c: ("" if r.get(c) is None else _cell(r.get(c))) for c in cols})
    atomic_write_bytes(str(path), buf.getvalue().encode())


_FORMATS = {"accuracy": "{:.3f}", "nfe_per_prompt": "{:.2f}", "tpf": "{:.2f}", "tps": "{:.1f}",
            "wall_time": "{:.2f}", "job_time": "{:.1f}"}


def _fmt(v: Any, col: Optional[str] = None) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "yes" if v else ""
    if isinstance(v, float):
        return _FORMATS.get(col or "", "{:g}").format(v)
    return str(v)


def markdown_table(rows: Sequence[Dict[str, Any]], cols: Sequence[str]) -> str:
    headers = {"nfe_per_prompt": "NFE/prompt", "tpf": "TPF", "tps": "TPS", "accuracy": "accuracy",
               "wall_time": "wall s", "pareto": "Pareto"}
    lines = ["| " + " | ".join(headers.get(c, c) for c in cols) + " |",
             "|" + "|".join("---" for _ in cols) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r.get(c), c).replace("|", "\\|") for c in cols) + " |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------- plots
def _label(row: Dict[str, Any], keys: Sequence[str]) -> str:
    return ", ".join(f"{k.split('.')[-1]}={_fmt(row.get(k))}" for k in keys)


def _group_key(rows: Sequence[Dict[str, Any]], vary: Sequence[str]) -> Optional[str]:
    """Legend grouping: strategy when several are compared, else the varying setting with fewest values."""
    if "strategy" in vary:
        return "strategy"
    best = None
    for k in vary:
        n = len({json.dumps(r.get(k), default=str) for r in rows})
        if n <= 8 and (best is None or n < best[0]):
            best = (n, k)
    return best[1] if best else None


def _numeric_params(rows: Sequence[Dict[str, Any]], vary: Sequence[str]) -> List[str]:
    nums = [k for k in vary if all(_num(r.get(k)) for r in rows)]

    def rank(k: str) -> Tuple[int, str]:
        for i, word in enumerate(("threshold", "block_length", "buffer_size", "factor", "steps")):
            if word in k:
                return (i, k)
        return (9, k)

    return sorted(nums, key=rank)[:3]


def write_plots(rows: Sequence[Dict[str, Any]], settings: Sequence[str], out_dir: Path) -> Tuple[List[Path], List[str]]:
    """accuracy_vs_nfe.png and tps.png over the ``settings`` that vary; returns (written files, notes).
    Raises ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r.get("status") == "ok"]
    vary = varying(ok, settings)
    written, notes = [], []
    if not ok:
        return written, ["no finished jobs: nothing to plot"]
    group = _group_key(ok, vary)
    groups: Dict[str, List[Dict[str, Any]]] = {}
    for r in ok:
        groups.setdefault(_fmt(r.get(group)) if group else "", []).append(r)
    rest = [k for k in vary if k != group]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]

    pts = [r for r in ok if _num(r.get("accuracy")) and _num(r.get("nfe_per_prompt"))]
    if pts:
        fig, ax = plt.subplots(figsize=(6.4, 4.4), dpi=100)
        for i, (g, rs) in enumerate(sorted(groups.items(), key=lambda kv: _sort_key(_parse_scalar(kv[0])))):
            rs = [r for r in rs if r in pts]
            ax.scatter([r["nfe_per_prompt"] for r in rs], [r["accuracy"] for r in rs], s=36, alpha=0.8,
                       color=colors[i % len(colors)], label=f"{group.split('.')[-1]}={g}" if group else None, zorder=2)
        front = sorted((r for r in pts if r.get("pareto")), key=lambda r: (r["nfe_per_prompt"], -r["accuracy"]))
        if front:
            ax.plot([r["nfe_per_prompt"] for r in front], [r["accuracy"] for r in front], drawstyle="steps-post",
                    color="black", lw=1.2, zorder=1, label="Pareto front")
            ax.scatter([r["nfe_per_prompt"] for r in front], [r["accuracy"] for r in front], s=110,
                       facecolors="none", edgecolors="black", lw=1.4, zorder=3)
            if len(front) <= 12 and rest:
                for r in front:
                    ax.annotate(_label(r, rest), (r["nfe_per_prompt"], r["accuracy"]), textcoords="offset points",
                                xytext=(5, -11), fontsize=7)
        ax.set_xlabel("NFE per prompt (mean model forward calls)")
        ax.set_ylabel("accuracy (exact match)")
        ax.set_title("accuracy vs NFE")
        ax.grid(alpha=0.3)
        if group or front:
            ax.legend(fontsize=8, loc="best")
        written.append(_save_figure(plt, fig, Path(out_dir) / "accuracy_vs_nfe.png"))
    else:
        notes.append("no accuracy in the results (the task has no checker): accuracy_vs_nfe.png not written")

    tps_rows = [r for r in ok if _num(r.get("tps"))]
    if tps_rows:
        params = _numeric_params(tps_rows, vary)
        if params:
            fig, axes = plt.subplots(1, len(params), figsize=(4.6 * len(params), 3.8), dpi=100, squeeze=False)
            for ax, p in zip(axes[0], params):
                others = [k for k in vary if k != p]
                lines: Dict[Tuple, List[Dict[str, Any]]] = {}
                for r in tps_rows:
                    lines.setdefault(tuple(_sort_key(r.get(k)) for k in others), []).append(r)
                many = len(lines) > 8
                for i, (_, rs) in enumerate(sorted(lines.items())):
                    rs = sorted(rs, key=lambda r: r[p])
                    lab = _label(rs[0], others)
                    ax.plot([r[p] for r in rs], [r["tps"] for r in rs], marker="o", ms=4, lw=1,
                            color=colors[i % len(colors)], label=None if many or not lab else lab)
                xs = sorted({r[p] for r in tps_rows})
                if len(xs) <= 8:
                    ax.set_xticks(xs, [_fmt(x) for x in xs])
                ax.set_ylim(bottom=0)
                ax.set_xlabel(p)
                ax.set_ylabel("TPS (generated tokens / s)")
                ax.grid(alpha=0.3)
                if not many and others:
                    ax.legend(fontsize=7)
            fig.suptitle("tokens per second")
        else:
            fig, ax = plt.subplots(figsize=(6.4, 0.35 * len(tps_rows) + 1.2), dpi=100)
            labels = [(_label(r, vary) or str(r.get("strategy") or r["job"]))[:48] for r in tps_rows]
            ax.barh(range(len(tps_rows)), [r["tps"] for r in tps_rows], color=colors[0])
            ax.set_yticks(range(len(tps_rows)), labels, fontsize=7)
            ax.set_xlabel("TPS (generated tokens / s)")
            ax.invert_yaxis()
            ax.grid(alpha=0.3, axis="x")
        written.append(_save_figure(plt, fig, Path(out_dir) / "tps.png"))
    return written, notes


def _save_figure(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------------------- aggregate
def aggregate(root: Path, plots: bool = True, out=None) -> Dict[str, Any]:
    """Scan ``root`` and write ``sweep.csv``, ``sweep.md`` and the plots there; prints a summary."""
    from .fsutil import atomic_write_bytes

    out = out or sys.stdout
    root = Path(root)
    jobs = [j for j in scan(root)]
    rows, settings, metric_cols, swept = rows_from_jobs(jobs)
    counts: Dict[str, int] = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    report = {"jobs": len(rows), "counts": counts, "files": [], "notes": []}
    if not rows:
        print(f"dlm-sweep: no jobs under {root} (looked for {RESULT}, {ERROR} and .hydra/ directories)", file=out)
        return report
    cols = ["job", "status"] + settings + [c for c in metric_cols if c in ("trace_path", "trace_digest", "error")
                                            or any(r.get(c) is not None for r in rows)]
    write_csv(root / "sweep.csv", rows, cols)
    ok = [r for r in rows if r["status"] == "ok"]
    shown_settings = varying(rows, swept) or settings[:1]
    shown = shown_settings + [c for c in ("accuracy", "nfe_per_prompt", "tpf", "tps", "pareto")
                              if any(r.get(c) is not None for r in ok)]
    if len(counts) > 1 or "ok" not in counts:
        shown = ["status"] + shown
    table = markdown_table(rows, shown)
    atomic_write_bytes(str(root / "sweep.md"), table.encode())
    report["files"] += [root / "sweep.csv", root / "sweep.md"]
    if plots:
        try:
            files, notes = write_plots(rows, swept, root)
            report["files"] += files
            report["notes"] += notes
        except ImportError:
            report["notes"].append(f"plots skipped: matplotlib is not installed ({VIZ_HINT})")
    summary = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
    print(f"sweep {root}: {len(rows)} jobs ({summary})", file=out)
    lines = table.splitlines()
    if len(lines) > 2 + MAX_PRINTED_ROWS:  # large sweeps: the files have every row
        lines = lines[:2 + MAX_PRINTED_ROWS] + [f"... {len(lines) - 2 - MAX_PRINTED_ROWS} more rows in sweep.md"]
    print("\n".join(lines), file=out)
    for f in report["files"]:
        print(f"wrote {f}", file=out)
    for n in report["notes"]:
        print(n, file=out)
    bad = [r for r in rows if r["status"] != "ok"]
    for r in bad:
        print(f"{r['status']}: {r['job']}" + (f": {r['error']}" if r.get("error") else ""), file=out)
    if bad:
        print(f"{len(bad)} job(s) without a result; re-run the same command with hydra.sweep.dir={root} "
              f"to run only those", file=out)
    out.flush()
    return report


class AggregateCallback(_HydraCallback):
    """Hydra callback: says what a resumed sweep will skip, aggregates the sweep directory at the end.

    Configured by ``conf/hydra/callbacks/sweep.yaml``. It keeps no state: the end-of-multirun step scans
    the result files, like ``dlm-sweep DIR`` (which covers sweeps that failed and never reach the end).
    """

    def __init__(self, plots: bool = True):
        self.plots = plots

    def on_multirun_start(self, config, **kwargs) -> None:
        root = Path(str(config.hydra.sweep.dir))
        done = sum(1 for j in scan(root) if j.get("status") == "ok") if root.is_dir() else 0
        if done and not bool(config.get("resume", True)):
            print(f"dlm: sweep {root}: {done} finished job(s) found; resume=false re-runs them", flush=True)
        elif done:
            print(f"dlm: resuming sweep {root}: {done} finished job(s) found (result.json); jobs with the same "
                  f"overrides and config are skipped (resume=false re-runs them)", flush=True)
        else:
            print(f"dlm: sweep dir {root} (re-run with hydra.sweep.dir={root} to resume)", flush=True)

    def on_multirun_end(self, config, **kwargs) -> None:
        root = Path(str(config.hydra.sweep.dir))
        try:
            report = aggregate(root, plots=self.plots)
        except Exception as exc:  # the jobs' results are safe on disk; do not fail the sweep here
            print(f"dlm: sweep aggregation failed ({type(exc).__name__}: {exc}); run `dlm-sweep {root}`",
                  file=sys.stderr, flush=True)
            return
        failed = report["counts"].get("failed", 0)
        if failed:  # jobs with a user error returned normally so the others could run: exit non-zero here
            print(f"dlm: error: {failed} job(s) of the sweep failed (error.json in their directories)",
                  file=sys.stderr, flush=True)
            sys.exit(1)


# --------------------------------------------------------------------------------------- dlm-sweep
def main(argv: Optional[Sequence[str]] = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(
        prog="dlm-sweep",
        description="Aggregate a (partial or failed) `dlm -m` sweep directory: scans every job's result.json "
                    "and writes sweep.csv, sweep.md and plots (accuracy_vs_nfe.png, tps.png) into DIR.")
    ap.add_argument("dir", metavar="DIR", help="the sweep directory (hydra.sweep.dir)")
    ap.add_argument("--no-plots", action="store_true", help="write only the tables")
    args = ap.parse_args(argv)
    root = Path(args.dir)
    if not root.is_dir():
        print(f"dlm-sweep: error: {root} is not a directory", file=sys.stderr)
        return 2
    try:
        report = aggregate(root, plots=not args.no_plots)
    except BrokenPipeError:  # `dlm-sweep DIR | head`: the files are written before the table is printed
        return 0
    return 0 if report["jobs"] else 1


if __name__ == "__main__":
    sys.exit(main())
