"""Scanning a sweep directory: every job's ``result.json`` / ``error.json``, or the Hydra job directory of a
job that has neither (incomplete)."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, List

from dlm_engine.app.jobs import ERROR, RESULT

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
