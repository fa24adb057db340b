"""Do the integer stream codecs pay? Bytes per generated position of real `dlm` runs' traces with every
integer stream method, and with each of zstd byte planes, bit packing and Rice coding turned off.

    python experiments/trace_codecs.py            # runs the real runs of bench_trace.py (indices 1, 4, 5, 8, 9)
    python experiments/trace_codecs.py A.dlmt ... # or measures the traces named

The sequence records of each trace are encoded again under each variant (the encoder keeps the smallest of
what is left: byte planes are always there); the other records are taken as written. The figure is the file's
bytes minus its preamble and header record, per generated position (as in ``bench_trace.py``)."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_trace import REAL_RUNS, trace_bytes  # noqa: E402

from dlm_engine.trace import codecs  # noqa: E402
from dlm_engine.trace import format as fmt  # noqa: E402
from dlm_engine.trace import framing  # noqa: E402
from dlm_engine.trace import open_trace  # noqa: E402

RUNS = (1, 4, 5, 8, 9)


@contextlib.contextmanager
def without(method: str):
    """The encoder with one integer stream method left out (``none``: as shipped)."""
    saved = {k: getattr(codecs, k) for k in ("RICE_KMAX", "_unary_best", "zc")}
    if method in ("rice", "all"):
        codecs.RICE_KMAX = -1
    if method in ("bits", "all"):
        def planes_only(n, vmax, _f=saved["_unary_best"]):
            best, nb, width = _f(n, vmax)
            return (n * nb, codecs.M_PLANES, nb), nb, width
        codecs._unary_best = planes_only
    if method in ("zstd", "all"):     # an integer stream's zstd frame is never smaller than its planes
        codecs.zc = lambda data, level=framing.ZSTD_LEVEL, _z=saved["zc"]: _z(data, level) + b"\0" * len(data)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(codecs, k, v)


def measure(path: str):
    body, pos, _ = trace_bytes(path)
    tr = open_trace(path, recover=False)
    seqs = [s._data for s in tr]
    written = sum(len(r.payload) for r in tr.records if r.kind == fmt.SEQ)
    out = {}
    for m in ("none", "zstd", "bits", "rice", "all"):
        with without(m):
            size = sum(len(p) for p in fmt.encode_seqs(seqs))
        out[m] = (body - written + size) / pos
    return out


def main(argv):
    paths = list(argv)
    if not paths:
        tmp = tempfile.mkdtemp(prefix="trace-codecs-")
        for i in RUNS:
            label, overrides = REAL_RUNS[i]
            d = os.path.join(tmp, f"run{i}")
            cmd = [os.path.join(os.path.dirname(sys.executable), "dlm")] + overrides + [f"hydra.run.dir={d}"]
            subprocess.run(cmd, capture_output=True, text=True, check=True)
            paths.append((label, os.path.join(d, "trace.dlmt")))
    else:
        paths = [(p, p) for p in paths]
    print(f"{'run':<37} {'all':>6} {'-zstd':>6} {'-bits':>6} {'-Rice':>6} {'planes':>6}  (bytes per generated position)")
    for label, p in paths:
        r = measure(p)
        print(f"{label:<37} " + " ".join(f"{r[m]:>6.2f}" for m in ("none", "zstd", "bits", "rice", "all")))


if __name__ == "__main__":
    main(sys.argv[1:])
