"""``keep_freed_memory``: with glibc's thresholds fixed, a step's large temporaries are reused from the heap instead of
being handed back to the system and faulted in again next step (EB-Sampler's overhead on the d256 bench: 17.8% ->
9.8%). Measured in fresh processes: the allocator's state is per process."""
import os
import platform
import subprocess
import sys

import pytest

from conftest import ROOT

PROBE = r"""
import ctypes, sys, torch
from dlm_engine.core.memory import keep_freed_memory
applied = keep_freed_memory()
libc = ctypes.CDLL(None)
fields = ["arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost"]
try:                                   # glibc >= 2.33
    info, kind = libc.mallinfo2, ctypes.c_size_t
except AttributeError:
    info, kind = libc.mallinfo, ctypes.c_int
class Info(ctypes.Structure):
    _fields_ = [(f, kind) for f in fields]
info.restype = Info
def cycle():
    # four 24 MiB buffers at once, freed together (a step's temporaries): below the fixed 32 MiB mmap threshold
    # they come from the heap, and 96 MiB free at its top stays under the fixed 256 MiB trim threshold; with
    # glibc's own adaptive thresholds they are unmapped on free, or the heap's top is trimmed (more than twice the
    # threshold free), and the next step faults them in again
    bufs = [torch.empty(6 << 20).fill_(1.0) for _ in range(4)]
    del bufs
for _ in range(3):
    cycle()
free = info().fordblks                 # free bytes the heap keeps after the step's temporaries are gone
before = info().hblks
big = torch.empty(31 << 18)            # 31 MiB: mapped of its own unless the mmap threshold is above it
mapped = info().hblks - before
print(applied, free, mapped)
"""


def _probe(env_value):
    env = dict(os.environ, DLM_ENGINE_KEEP_FREED_MEMORY=env_value, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    applied, free, mapped = out.stdout.split()
    return applied == "True", int(free), int(mapped)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
                    reason="glibc's mallopt (other C libraries keep their defaults)")
def test_fixed_thresholds_keep_a_steps_large_temporaries_in_the_heap():
    """Counted by the allocator (``mallinfo``), not by page faults (transparent huge pages change those): with the
    fixed thresholds the 96 MiB freed stay in the heap for the next step (>= 90 MiB free: small allocations may
    take some of it), and a 31 MiB block comes from the heap too. With glibc's defaults the outcome depends on the
    process' allocation history (the thresholds adapt), so that side is not asserted: the freed blocks went back
    in 9 of 10 fresh processes here."""
    applied, kept, mapped = _probe("1")
    assert applied and kept >= 90 << 20 and mapped == 0, (applied, kept, mapped)
    assert not _probe("0")[0]


def test_the_switch_is_read_once_and_honoured(monkeypatch):
    import dlm_engine.core.memory as memory

    monkeypatch.setattr(memory, "_applied", None)
    monkeypatch.setenv(memory.ENV, "off")
    assert memory.keep_freed_memory() is False
    monkeypatch.setenv(memory.ENV, "1")
    assert memory.keep_freed_memory() is False   # (the first answer stands for the process)


def test_the_console_scripts_keep_freed_memory(monkeypatch, tmp_path):
    """``dlm`` and ``dlm-trace`` fix the thresholds before they decode (checked by the call, not the allocator)."""
    import dlm_engine.core.memory as memory
    from dlm_engine.app import cli
    from dlm_engine.trace import cli as trace_cli

    calls = []
    monkeypatch.setattr(memory, "keep_freed_memory", lambda: calls.append(1) or True)
    monkeypatch.setattr(sys, "argv", ["dlm", "strategy=no_such_strategy", f"hydra.run.dir={tmp_path / 'run'}"])
    with pytest.raises(SystemExit):
        cli.main()
    assert calls
    calls.clear()
    assert trace_cli.main(["show", str(tmp_path / "missing.dlmt")]) == 2
    assert calls
