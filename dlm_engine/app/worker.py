"""Workers of a local parallel launcher (joblib/loky) end with the sweep that started them.

loky's worker processes outlive a ``dlm -m hydra/launcher=joblib`` process that is killed (SIGKILL, SIGTERM,
a closed terminal): they are re-parented and keep decoding. :func:`exit_with_parent` starts a daemon thread
in the worker that notices the parent is gone, interrupts the job as Ctrl-C would (the job's trace is
flushed to its ``.partial`` file), and ends the process after a grace period.
"""
from __future__ import annotations

import os
import signal
import threading
import time

_started = False


def exit_with_parent(poll: float = 1.0, grace: float = 10.0) -> None:
    """Idempotent: one watcher per process, bound to the parent it has now."""
    global _started
    if _started:
        return
    _started = True
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll)
        try:
            os.kill(os.getpid(), signal.SIGINT)
        except OSError:
            pass
        time.sleep(grace)
        os._exit(130)

    threading.Thread(target=watch, name="dlm-exit-with-parent", daemon=True).start()


def uses_local_pool() -> bool:
    """True in a job run by the joblib launcher (local worker processes that must not outlive the sweep)."""
    from dlm_engine.app.jobs import launcher_target

    return "joblib" in launcher_target().lower()
