"""Keep freed memory in the process instead of handing it back to the system every step.

glibc's ``malloc`` serves blocks above its mmap threshold with fresh mappings and unmaps them on ``free``, and trims
the heap's top once more than twice that threshold is free. The threshold adapts to the largest block freed, so
which blocks go back depends on the allocation history. A decode makes the same large temporaries every step: the
model's activations, and float64 softmaxes or entropies over positions x vocabulary in the samplers. Every block
that went back has its pages faulted in and zeroed again on the next step. On the d256 bench
(``experiments/bench_overhead.py``) EB-Sampler took up to ~1,000 minor faults and 2 ms of system time a step that
way. With the two fixed thresholds below it took none: its overhead went from 17.8% to 9.8%, block_buffer's from
9.7% to 6.8%, KLASS's from 9.4% to 7.8% (A/B in one sitting), and the model's own time fell a little too.

The console scripts (``dlm``, ``dlm-trace``, ``dlm-lm-eval``) and the benchmarks call :func:`keep_freed_memory` at
start; a library user may call it too. The cost is memory: up to ``TRIM_THRESHOLD`` of freed heap stays with the
process. ``DLM_ENGINE_KEEP_FREED_MEMORY=0`` leaves the C library's defaults alone. Other C libraries (musl) and
other systems: nothing changes.
"""
from __future__ import annotations

import ctypes
import os
import sys
from typing import Optional

M_TRIM_THRESHOLD = -1          # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20      # blocks below this come from the heap (glibc's largest allowed value on 64-bit)
TRIM_THRESHOLD = 256 << 20     # free heap kept before the top is trimmed
ENV = "DLM_ENGINE_KEEP_FREED_MEMORY"

_applied: Optional[bool] = None


def keep_freed_memory() -> bool:
    """Fix glibc's mmap threshold at ``MMAP_THRESHOLD`` and its trim threshold at ``TRIM_THRESHOLD`` for this
    process (once; later calls return the first call's answer). Returns whether they are set: False where
    ``DLM_ENGINE_KEEP_FREED_MEMORY`` is ``0``/``false``/``no``/``off``, off Linux, or where the C library has no
    working ``mallopt``."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off") or not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    # (mallopt returns 1 on success; musl's stub returns 0)
    _applied = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _applied
