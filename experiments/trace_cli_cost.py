"""Start-up time and peak memory of the dlm-trace read commands on a small trace.

    python experiments/trace_cli_cost.py [--repeat N]

Records the default task with the embedded model (50 prompts, `dlm`), then runs every read command N times
in a fresh interpreter each, as a user would: wall time (median, min), peak RSS of that process (VmHWM),
and whether torch or transformers were imported. Targets (issue 16): < 1 s, < 200 MB, neither imported.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# the console script's own code, plus a report of this process's peak memory and heavy imports at exit
WRAP = r"""
import atexit, json, sys
def report():
    with open("/proc/self/status") as f:
        hwm = next(int(l.split()[1]) for l in f if l.startswith("VmHWM:"))
    sys.stderr.write("\nCOST " + json.dumps({"kb": hwm, "heavy": [m for m in ("torch", "transformers") if m in sys.modules]}) + "\n")
atexit.register(report)
sys.argv = ["dlm-trace"] + sys.argv[1:]
from dlm_engine.trace.cli import main
main()
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        run = os.path.join(d, "run")
        dlm = os.path.join(os.path.dirname(sys.executable), "dlm")
        subprocess.run([dlm, f"hydra.run.dir={run}", "device=cpu", "print_outputs=false"], check=True,
                       stdout=subprocess.DEVNULL)
        t = os.path.join(run, "trace.dlmt")
        print(f"trace: {os.path.getsize(t)} bytes, 50 rows (embedded tiny model, default task)")
        print(f"{'command':<34} {'median s':>9} {'min s':>7} {'peak MB':>8}  torch/transformers imported")
        for cmd in (["show", t], ["replay", t], ["replay", t, "--step", "5"], ["replay", t, "--json"],
                    ["diff", t, t], ["html", t, "-o", os.path.join(d, "v.html")], ["verify", t]):
            times, cost = [], None
            for _ in range(a.repeat):
                t0 = time.perf_counter()
                p = subprocess.run([sys.executable, "-c", WRAP, *cmd], capture_output=True, text=True)
                times.append(time.perf_counter() - t0)
                assert p.returncode == 0, p.stderr
                cost = json.loads(p.stderr.rsplit("COST ", 1)[1])
                extra = p.stderr.rsplit("COST ", 1)[0].strip()
                assert not extra, extra            # no warning, no note
            name = " ".join(c if c != t else "TRACE" for c in cmd).replace(os.path.join(d, "v.html"), "OUT")
            print(f"dlm-trace {name:<24} {statistics.median(times):>9.2f} {min(times):>7.2f} {cost['kb'] / 1024:>8.0f}  "
                  f"{', '.join(cost['heavy']) or 'no'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
