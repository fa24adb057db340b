"""Measuring the step loop: host synchronisations and CPU time per section, outside the model.

Nothing here is used by a normal decode; benchmarks and tests wrap a decode with these context managers.

* :class:`SyncCounter` counts the tensor operations that force the host to wait for the device (``item``,
  ``tolist``, ``bool(t)``, ``int(t)``, ``float(t)``, ``nonzero``, boolean-mask indexing, ``unique``,
  ``.cpu()``/``.numpy()``) and the tensors made from host lists outside :func:`dlm_engine.core.devices.host_tensor`
  (a copy the host waits for on a GPU), outside the model's forward. On a CPU they cost little, on a GPU each one stalls
  the device. It also counts every tensor operation outside the model (``ops``: a kernel launch each on a GPU).
* :class:`Sections` accumulates CPU time (``time.thread_time``) in the model forward, ``plan``, the sampler,
  ``select``, ``canvas.apply`` and the sinks.
* :class:`OpProfile` attributes every tensor operation outside the model to the framework line that made it, with
  its count and CPU time: where to cut when the sections say a step costs too much.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager
from typing import Dict, Iterator, List, Optional, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dlm_engine.core.devices import staging

_METHODS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "cpu", "numpy")
_FUNCTIONS = ("nonzero", "unique", "masked_select", "argwhere")


class ModelTimer:
    """Wraps a model: CPU time spent in its forward; marks the forward so :class:`SyncCounter` can skip it."""

    def __init__(self, model):
        self.model, self.cpu, self.calls, self.inside = model, 0.0, 0, False

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        self.inside = True
        t0 = time.thread_time()
        try:
            return self.model(*args, **kwargs)
        finally:
            self.cpu += time.thread_time() - t0
            self.inside = False


class SyncCounter:
    """Counts host-synchronising tensor operations made outside ``timer``'s model forward (all of them when
    ``timer`` is None), by name, on the thread that entered it (a trace writer's thread reads its own copies);
    with ``where`` also the calling line of each (``stacks``). Use as a context manager around a decode."""

    def __init__(self, timer: ModelTimer = None, where: bool = False):
        self.timer, self.where = timer, where
        self.counts: Dict[str, int] = {}
        self.ops = 0         # tensor operations outside the model (kernel launches on a GPU)
        self.stacks: List[str] = []
        self._saved = []

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def _count(self, name: str) -> None:
        if self.timer is not None and self.timer.inside or threading.get_ident() != self._thread:
            return
        self.counts[name] = self.counts.get(name, 0) + 1
        if self.where:
            import traceback

            frame = traceback.extract_stack(limit=4)[0]
            self.stacks.append(f"{name} at {frame.filename}:{frame.lineno} ({frame.name})")

    def __enter__(self) -> "SyncCounter":
        self._thread = threading.get_ident()
        T = torch.Tensor
        self._own = {n for n in _METHODS if n in vars(T)}
        for name in _METHODS:
            orig = getattr(T, name)
            self._saved.append((T, name, orig))
            setattr(T, name, self._wrap(name, orig))
        for name in _FUNCTIONS:
            orig = getattr(torch, name)
            self._saved.append((torch, name, orig))
            setattr(torch, name, self._wrap(f"torch.{name}", orig))
        # boolean-mask indexing is seen where it reaches ATen (patching Tensor.__getitem__ would make CPython
        # treat every tensor as a sequence for good: torch.tensor([t0d, 0.0]) then fails, even once restored)
        self._mode = _MaskIndex(self)
        self._mode.__enter__()
        return self

    def _wrap(self, name, orig):
        counter = self

        def wrapped(*args, **kwargs):
            counter._count(name)
            return orig(*args, **kwargs)

        return wrapped

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        for owner, name, orig in reversed(self._saved):
            if owner is torch.Tensor and name not in self._own:
                delattr(owner, name)      # it was inherited (from TensorBase): leave no copy on Tensor
            else:
                setattr(owner, name, orig)
        self._saved = []


def _bool_index(idx) -> bool:
    items = idx if isinstance(idx, (tuple, list)) else (idx,)
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in items)


# a tensor made from host data (``torch.tensor``/``as_tensor``). 0-dim ones are left out: ``x[i] = 1.0`` makes one
# too, and a Python scalar reaches a GPU as a kernel argument, without a copy. On a CPU-only run this is what can be
# seen of a host-to-device copy; ``cpu_tensor.to("cuda")`` (pageable memory, also a wait) is only visible on a GPU
_LIFT = torch.ops.aten.lift_fresh.default
_INDEXING = (torch.ops.aten.index.Tensor, torch.ops.aten.index_put.default, torch.ops.aten.index_put_.default)


class _MaskIndex(TorchDispatchMode):
    """Counts indexing with a boolean index (``x[mask]``, ``x[mask] = v``: a nonzero, i.e. a host read, inside)
    and every op outside the model."""

    def __init__(self, counter: "SyncCounter"):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        c = self.counter
        if c.timer is None or not c.timer.inside:
            c.ops += 1
            if func in _INDEXING and _bool_index(args[1]):      # x[mask], x[mask] = v
                c._count("mask-index")
            elif func is _LIFT and args[0].dim() > 0 and not staging():
                c._count("host-tensor")        # torch.tensor(host list, device=...): a waited-for copy on a GPU
        return func(*args, **(kwargs or {}))


class Sections:
    """CPU time per section of the step loop (patched around one decode)."""

    def __init__(self):
        self.cpu: Dict[str, float] = {}

    def add(self, name: str, dt: float) -> None:
        self.cpu[name] = self.cpu.get(name, 0.0) + dt

    def timed(self, name: str, fn):
        def wrapped(*args, **kwargs):
            t0 = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(name, time.thread_time() - t0)

        return wrapped

    @contextmanager
    def around(self, strategy, sinks=()) -> Iterator["Sections"]:
        """Time ``plan``/``select`` of ``strategy``, the loop's sampler, ``Canvas.apply`` and the sinks."""
        import dlm_engine.core.loop as loop
        from dlm_engine.core.canvas import Canvas

        saved = [(strategy, "plan", strategy.plan), (strategy, "select", strategy.select),
                 (loop, "sample", loop.sample), (Canvas, "apply", Canvas.apply)]
        strategy.plan = self.timed("plan", strategy.plan)
        strategy.select = self.timed("select", strategy.select)
        loop.sample = self.timed("sample", loop.sample)
        Canvas.apply = self.timed("apply", Canvas.apply)
        for s in sinks:
            saved.append((s, "on_delta", s.on_delta))
            s.on_delta = self.timed("sinks", s.on_delta)
        try:
            yield self
        finally:
            for owner, name, orig in saved:
                if owner is strategy or owner in sinks:
                    delattr(owner, name) if name in vars(owner) else None
                else:
                    setattr(owner, name, orig)


# the source trees whose lines an op is attributed to (dlm_engine, strategies/, cache/: one checkout's root)
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_OWN_TREES = tuple(os.path.join(_ROOT, d) + os.sep for d in ("dlm_engine", "strategies", "cache"))


class OpProfile(TorchDispatchMode):
    """Every tensor operation outside ``timer``'s model forward, made on the thread that entered the profile (a
    dispatch mode is thread-local): ``(op, line) -> [count, CPU seconds]``, where ``line`` is the innermost line
    of the framework's own code (``dlm_engine``, ``strategies/``, ``cache/``) that led to it --
    ``dlm_engine/core/sampler.py:117 softmax_in``.
    The CPU time is the thread's clock around the op (the profile's own dispatch adds ~1 us to each), so read the
    figures relative to each other; :class:`SyncCounter`'s ``ops`` is the same count."""

    def __init__(self, timer: Optional[ModelTimer] = None):
        super().__init__()
        self.timer = timer
        self.ops: Dict[Tuple[str, str], List[float]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.timer is not None and self.timer.inside:
            return func(*args, **(kwargs or {}))
        t0 = time.thread_time()
        out = func(*args, **(kwargs or {}))
        dt = time.thread_time() - t0
        key = (str(func), self._line())
        got = self.ops.get(key)
        if got is None:
            self.ops[key] = [1, dt]
        else:
            got[0] += 1
            got[1] += dt
        return out

    @staticmethod
    def _line() -> str:
        f = sys._getframe(2)
        while f is not None:
            name = f.f_code.co_filename
            if name.startswith(_OWN_TREES) and not name.endswith("instrument.py"):
                return f"{os.path.relpath(name, _ROOT)}:{f.f_lineno} {f.f_code.co_name}"
            f = f.f_back
        return "(outside the framework)"

    @property
    def count(self) -> int:
        return int(sum(v[0] for v in self.ops.values()))

    def table(self, steps: int, top: int = 15) -> List[str]:
        """The ``top`` most expensive ``(op, line)`` pairs, per step: ``CPU us  count  op  line``."""
        rows = sorted(self.ops.items(), key=lambda kv: -kv[1][1])[:top]
        return [f"{1e6 * t / steps:8.1f} us {n / steps:5.2f}x  {op:<34} {line}" for (op, line), (n, t) in rows]
