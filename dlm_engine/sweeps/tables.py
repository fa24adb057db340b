"""Sweep tables: job records flattened into rows, the accuracy-vs-NFE Pareto front, CSV and Markdown."""
from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from dlm_engine.metrics import METRICS_VERSION
from dlm_engine.app.jobs import NEUTRAL_KEYS, split_override

# result.json metric -> sweep.csv column ("prompts" is also a config key, hence n_prompts)
# NFE, TPF and latency are per sequence (dlm_engine.metrics); model_calls is the only batch-dependent count
METRICS = {"accuracy": "accuracy", "nfe_per_prompt": "nfe_per_prompt", "nfe": "nfe", "tpf": "tpf", "tps": "tps",
           "latency_mean": "latency_mean", "model_calls": "model_calls", "wall_time": "wall_time",
           "job_time": "job_time", "generated_tokens": "generated_tokens", "prompts": "n_prompts"}
SKIP_OVERRIDE_KEYS = {"sweep"} | set(NEUTRAL_KEYS)
RESERVED = {"job", "status", "pareto", "trace_path", "trace_digest", "error", *METRICS.values()}


def parse_scalar(text: str) -> Any:
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
        if row["status"] == "ok" and job.get("metrics_version") != METRICS_VERSION:
            row["status"] = "stale"  # written under older metric definitions (batch-dependent TPF): re-run it
        settings: Dict[str, Any] = {}
        strat = job.get("strategy") if isinstance(job.get("strategy"), dict) else {}
        cache = job.get("cache") if isinstance(job.get("cache"), dict) else {}
        if strat:
            settings["strategy"] = strat.get("preset") or strat.get("name")   # the preset picked (pc_sampler: d2c's)
            settings.update({f"strategy.{k}": v for k, v in strat.items() if k not in ("name", "preset")})
        if cache:
            settings["cache"] = cache.get("name")
            settings.update({f"cache.{k}": v for k, v in cache.items() if k != "name"})
        if job.get("model") is not None:
            settings["model"] = job.get("model")
        config = job.get("config") or {}
        for ov in job.get("overrides") or []:
            key, val = split_override(ov)
            if key == "strategy" and strat and not strat.get("preset"):   # (results written before the label)
                settings["strategy"] = parse_scalar(val)
            if key.startswith("hydra") or key in SKIP_OVERRIDE_KEYS or key in RESERVED:
                continue
            if key not in swept:
                swept.append(key)
            if key in settings:
                continue
            found, value = _select(config, key)
            if found and isinstance(value, dict) and "name" in value:  # a group choice: its name
                value = value["name"]
            settings[key] = _cell(value) if found else parse_scalar(val)
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
    rows.sort(key=lambda r: tuple(sort_key(r.get(c)) for c in setting_cols) + (sort_key(r["job"]),))
    metric_cols = list(METRICS.values()) + ["pareto"] + sorted(task_cols) + ["trace_path", "trace_digest", "error"]
    return rows, setting_cols, metric_cols, swept


def sort_key(v: Any) -> Tuple[int, Any]:
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
           if r.get("status") == "ok" and is_number(r.get("accuracy")) and is_number(r.get("nfe_per_prompt"))]
    for r in rows:
        r["pareto"] = None
    for i, acc, nfe in pts:
        dominated = any(a >= acc and n <= nfe and (a > acc or n < nfe) for j, a, n in pts if j != i)
        rows[i]["pareto"] = not dominated


def is_number(v: Any) -> bool:
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
    from dlm_engine.fsutil import atomic_write_bytes

    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(cols), extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({c: ("" if r.get(c) is None else _cell(r.get(c))) for c in cols})
    atomic_write_bytes(str(path), buf.getvalue().encode())


_FORMATS = {"accuracy": "{:.3f}", "nfe_per_prompt": "{:.2f}", "tpf": "{:.2f}", "tps": "{:.1f}", "latency_mean": "{:.3f}",
            "wall_time": "{:.2f}", "job_time": "{:.1f}"}


def format_value(v: Any, col: Optional[str] = None) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "yes" if v else ""
    if isinstance(v, float):
        return _FORMATS.get(col or "", "{:g}").format(v)
    return str(v)


def markdown_table(rows: Sequence[Dict[str, Any]], cols: Sequence[str]) -> str:
    headers = {"nfe_per_prompt": "NFE/seq", "tpf": "TPF", "tps": "TPS", "accuracy": "accuracy",
               "wall_time": "wall s", "pareto": "Pareto"}
    lines = ["| " + " | ".join(headers.get(c, c) for c in cols) + " |",
             "|" + "|".join("---" for _ in cols) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(format_value(r.get(c), c).replace("|", "\\|") for c in cols) + " |")
    return "\n".join(lines) + "\n"
