"""Atomic file writes: temp file in the same directory, fsync, rename."""
from __future__ import annotations

import json
import os
import tempfile
from typing import Any, Iterable


def _read_umask() -> int:
    # os.umask can only be read by setting it; do that once, at import, not while writer threads run
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


FILE_MODE = 0o666 & ~_read_umask()


def atomic_write_bytes(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` so readers see the old file or the whole new one, never a part. The file
    gets the usual permissions (0666 less the umask), not mkstemp's private 0600."""
    d = os.path.dirname(os.path.abspath(path)) or "."
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=d)
    try:
        os.chmod(tmp, FILE_MODE)
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
