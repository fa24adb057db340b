"""Fuzz the trace reader: random single-byte flips, truncations and the crafted hostile corpus.

    python experiments/fuzz_trace.py [--flips N] [--cuts N] [--rows R] [--seed S]

For every damaged file: *detected* = the strict reader or ``verify`` raises TraceError (one line),
*accepted* = it passes as intact, *crashed* = any other exception (a traceback). Then ``--recover`` on
the same file: the share of rows it returns and how many of them differ from the original (must be 0).
The crafted corpus (tests/trace_corpus.py) has valid record checksums and a recomputed end digest, so only
the reader's bounds and cross-checks catch it. Prints the peak memory of this process (VmHWM).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

import numpy as np  # noqa: E402

import trace_corpus as tc  # noqa: E402
from dlm_engine.trace import TraceError, loads  # noqa: E402
from dlm_engine.trace.tools import verify_integrity  # noqa: E402


RECORD = """
import sys
sys.path.insert(0, "tests")
import trace_corpus as tc
n = int(sys.argv[2])
tc.record_base(sys.argv[1], capture="confidence", batch_size=8,
               prompts=[tc.PROMPTS[i % len(tc.PROMPTS)] + str(i) for i in range(n)])
"""


def peak_mb() -> float:
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Tally:
    def __init__(self, name: str):
        self.name = name
        self.detected = self.accepted = self.crashed = 0
        self.rows_returned: list = []
        self.wrong_rows = 0
        self.unreadable = 0
        self.examples: list = []

    def check(self, data: bytes, ref, total_rows: int, label=None) -> None:
        try:
            verify_integrity(loads(data, recover=False))
            self.accepted += 1
            self.examples.append(f"accepted: {label}")
        except TraceError:
            self.detected += 1
        except Exception as exc:  # noqa: BLE001 - a crash is what we count
            self.crashed += 1
            self.examples.append(f"crashed: {label}: {type(exc).__name__}: {exc}")
        try:
            tr = loads(data, recover=True)
        except TraceError:
            self.rows_returned.append(0.0)       # nothing readable (e.g. the header itself is damaged)
            self.unreadable += 1
            return
        except Exception as exc:  # noqa: BLE001
            self.crashed += 1
            self.examples.append(f"crashed under --recover: {label}: {type(exc).__name__}: {exc}")
            return
        n, wrong = tc.check_recovered(tr, ref)
        self.rows_returned.append(n / total_rows)
        self.wrong_rows += wrong

    def line(self, n: int) -> str:
        r = np.array(self.rows_returned) if self.rows_returned else np.zeros(1)
        return (f"{self.name} ({n}): detected {self.detected}, accepted {self.accepted}, crashed {self.crashed}; "
                f"--recover returned {100 * r.mean():.1f}% of rows on average ({self.unreadable} files unreadable: "
                f"preamble or header damaged), wrong rows {self.wrong_rows}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--flips", type=int, default=5000)
    ap.add_argument("--cuts", type=int, default=2000)
    ap.add_argument("--rows", type=int, default=24, help="rows of the base trace (batches of 8)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rng = np.random.default_rng(a.seed)
    with tempfile.TemporaryDirectory() as d:     # recorded in a child: this process never imports torch
        path = os.path.join(d, "base.dlmt")
        subprocess.run([sys.executable, "-c", RECORD, path, str(a.rows)], check=True, cwd=ROOT)
        with open(path, "rb") as f:
            base = f.read()
    base_mb = peak_mb()
    t0 = time.perf_counter()
    tallies = fuzz(base, a.flips, a.cuts, rng, "base trace", "tiny_random model, low_confidence, capture=confidence; "
                   "format 2.1, step tables of 5 steps so that steps records and batch-end tables both occur")
    heavy = [m for m in ("torch", "transformers") if m in sys.modules]
    print(f"time {time.perf_counter() - t0:.1f} s; peak memory of this process {peak_mb():.0f} MB "
          f"({base_mb:.0f} MB before the first damaged file; torch/transformers imported: {heavy or 'no'})")
    bad = sum(t.accepted + t.crashed + t.wrong_rows for t in tallies)
    return 1 if bad else 0


def fuzz(base: bytes, n_flips: int, n_cuts: int, rng, title: str, what: str) -> list:
    ref = loads(base, recover=False)
    info = verify_integrity(ref)
    print(f"{title}: {len(ref)} rows, {len(ref.batches)} batches, {info['records']} records, {len(base)} bytes ({what})")
    flips = Tally("single-byte flips")
    for off, data in tc.flips(base, n_flips, rng):
        flips.check(data, ref, len(ref), label=f"byte {off}")
    print(flips.line(n_flips))
    cuts = Tally("truncations")
    n = 0
    for cut, data in tc.truncations(base, n_cuts, rng):
        n += 1
        cuts.check(data, ref, len(ref), label=f"cut at {cut}")
    print(cuts.line(n) + " (random cut points plus every record boundary)")
    crafted = Tally("crafted files")
    corpus = tc.crafted(base)
    for name, data in corpus.items():
        crafted.check(data, ref, len(ref), label=name)
    print(crafted.line(len(corpus)) + " (valid checksums and end digest; tests/trace_corpus.py)")
    for t in (flips, cuts, crafted):
        for e in t.examples[:5]:
            print(f"  {t.name}: {e}")
    return [flips, cuts, crafted]


if __name__ == "__main__":
    sys.exit(main())
