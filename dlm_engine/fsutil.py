"""Atomic file writes: temp file in the same directory, fsync, rename."""
from __future__ import annotations

import json
import os
import tempfile
from typing import Any, Iterable


def atomic_write_bytes(path: str, data: bytes) -> None:
    d = os.path.dirname(os.path.abspath(path)) or "."
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=d)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_json(path: str, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode())


def atomic_write_jsonl(path: str, rows: Iterable[Any]) -> None:
    atomic_write_bytes(path, "".join(json.dumps(r) + "\n" for r in rows).encode())
