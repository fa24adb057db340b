"""Host numbers onto the device without making the host wait.

``torch.tensor(values, device="cuda")`` copies from pageable host memory, and PyTorch waits for the stream to
finish such a copy: a host synchronisation as costly as ``.item()``. Per-step tensors built from host numbers
(row indices, per-row counts) therefore go through :func:`host_tensor`, which stages them in pinned memory and
copies without blocking. On the CPU it is ``torch.tensor``.

:class:`dlm_engine.core.instrument.SyncCounter` counts tensors made from host data outside this function
(``host-tensor``), so a plain ``torch.tensor(list, device=...)`` in the step loop fails the sync-budget test.
"""
from __future__ import annotations

from typing import Sequence, Union

import numpy as np
import torch

_staging = 0          # > 0 while host_tensor builds its tensor (read by the sync counter)


_NUMPY = {torch.bool: np.bool_, torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32,
          torch.float64: np.float64}


def host_tensor(values: Union[Sequence, int, float, bool], dtype: torch.dtype,
                device: Union[str, torch.device]) -> torch.Tensor:
    """``values`` (host numbers, nested sequences allowed) as a tensor of ``dtype`` on ``device``; on CUDA the
    copy is asynchronous (pinned staging buffer, kept alive by PyTorch's host allocator until the copy ran)."""
    global _staging
    np_dtype = _NUMPY.get(dtype)
    _staging += 1
    try:
        if isinstance(values, np.ndarray) and np_dtype is not None and np.can_cast(values.dtype, np_dtype, "safe"):
            # a host array: a copy in the wanted dtype, wrapped without torch.tensor's per-element walk (~1 us, not 3)
            t = torch.from_numpy(np.array(values, dtype=np_dtype, order="C", copy=True))
        else:
            t = torch.tensor(values, dtype=dtype)
    finally:
        _staging -= 1
    dev = torch.device(device)
    if dev.type == "cpu":
        return t
    if dev.type == "cuda":
        return t.pin_memory().to(dev, non_blocking=True)
    return t.to(dev)


def staging() -> bool:
    """True while :func:`host_tensor` builds a tensor (its copy does not make the host wait)."""
    return _staging > 0
