"""File-system helpers: atomic writes (temp file in the same directory, fsync, rename), one writer per run
directory (:class:`DirLock`), setting an earlier run's outputs aside, and one-line OSError messages."""
from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
import time
from typing import Any, Iterable, List, Optional


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
    try:
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=d)
    except OSError as exc:   # read-only, full or missing directory: name the file the user asked for
        if exc.errno is None:
            raise
        raise type(exc)(exc.errno, exc.strerror, path) from None
    try:
        os.chmod(tmp, FILE_MODE)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(exc, OSError) and exc.errno is not None and exc.filename in (None, tmp):
            raise type(exc)(exc.errno, exc.strerror, path) from None   # name the file the user asked for
        raise


def atomic_write_json(path: str, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode())


def atomic_write_jsonl(path: str, rows: Iterable[Any]) -> None:
    atomic_write_bytes(path, "".join(json.dumps(r) + "\n" for r in rows).encode())


def os_error_message(exc: OSError, where=None) -> str:
    """``PATH: No space left on device`` (the file and the errno text, no exception class); ``where`` names
    the path when the error does not (a failed write or fsync carries no file name)."""
    what = exc.strerror or str(exc)
    names = [str(n) for n in (exc.filename, exc.filename2) if n is not None] or ([str(where)] if where else [])
    return (" -> ".join(names) + ": " if names else "") + what


def fsync_dir(d: str) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class DirLock:
    """One writer per directory: an exclusive ``flock`` on ``DIR/.dlm.lock``.

    The kernel drops the lock when the holder exits or is killed, so a crashed run never leaves a stale
    lock. The file keeps a line naming the holder (pid, host, start time, command) for the error a second
    process gets. The file is never removed (removing a lock file lets two processes hold "the" lock).
    """

    NAME = ".dlm.lock"

    def __init__(self, directory):
        self.path = os.path.join(str(directory), self.NAME)
        self._fd: Optional[int] = None

    def acquire(self) -> bool:
        """True when this process now holds the directory; False when another process does."""
        import fcntl

        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, FILE_MODE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        except BaseException:
            os.close(fd)
            raise
        info = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S"),
                "command": " ".join(os.path.basename(a) if i == 0 else a for i, a in enumerate(sys.argv))[:300]}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        self._fd = fd
        return True

    def holder(self) -> str:
        """Who holds the directory, as recorded in the lock file (best effort: it may be mid-write)."""
        try:
            with open(self.path) as f:
                info = json.loads(f.read() or "{}")
            return (f"pid {info['pid']} on {info['host']} since {info['since']}"
                    + (f" ({info['command']})" if info.get("command") else ""))
        except (OSError, ValueError, KeyError, TypeError):
            return "another process"

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)          # closing the descriptor drops the flock
            self._fd = None


PREVIOUS = ".previous"


def set_aside(directory, names: Iterable[str]) -> List[str]:
    """Move the files ``names`` an earlier run left in ``directory`` into ``directory/.previous/`` (each with
    one atomic rename, before this run writes anything), so a new run's partial files never sit beside an
    older run's complete-looking ones. An older ``.previous`` is replaced. Returns the names moved."""
    d = str(directory)
    present = [n for n in names if os.path.lexists(os.path.join(d, n))]
    if not present:
        return []
    dest = os.path.join(d, PREVIOUS)
    if os.path.isdir(dest) and not os.path.islink(dest):
        import shutil

        shutil.rmtree(dest)
    os.makedirs(dest, exist_ok=True)
    for n in present:
        os.replace(os.path.join(d, n), os.path.join(dest, n))
    fsync_dir(d)
    return present


def drop_previous(directory) -> None:
    """Remove ``.previous/`` once a new run has finished (its outputs replace the set-aside ones)."""
    import shutil

    dest = os.path.join(str(directory), PREVIOUS)
    if os.path.isdir(dest) and not os.path.islink(dest):
        shutil.rmtree(dest, ignore_errors=True)
