"""`dlm` on a full, read-only or impossible output directory: one line, exit != 0, nothing left that looks complete.

    python experiments/env_failures.py [--sizes 12,16,...]      (KB)

As root (mount allowed) each run writes into a fresh tmpfs of the given size, then into a read-only tmpfs;
otherwise a per-process file-size limit (RLIMIT_FSIZE, EFBIG) stands in for the full disk. For every run it
prints the exit code, the number of stderr lines, whether a traceback appeared, and which complete-looking
files (summary.json, results.jsonl, trace.dlmt, result.json) are left; when summary.json is left, whether its
trace digest matches the trace beside it (a complete run) -- anything else counts as a bad outcome.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

COMPLETE = ("summary.json", "results.jsonl", "trace.dlmt", "result.json")
DLM = os.path.join(os.path.dirname(sys.executable), "dlm")


def run(out: str, limit=None):
    def pre():
        if limit:
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    p = subprocess.run([DLM, f"hydra.run.dir={out}", "device=cpu", "print_outputs=false"], capture_output=True,
                       text=True, env=dict(os.environ, HYDRA_FULL_ERROR="0"), preexec_fn=pre)
    left = [n for n in COMPLETE if os.path.exists(os.path.join(out, n))]
    ok = p.returncode != 0 and not left
    if p.returncode == 0 or "summary.json" in left:   # a finished run: its files must be whole and agree
        try:
            s = json.load(open(os.path.join(out, "summary.json")))
            digest = "sha256:" + hashlib.sha256(open(os.path.join(out, "trace.dlmt"), "rb").read()).hexdigest()
            ok = p.returncode == 0 and s["trace_digest"] == digest and set(left) == set(COMPLETE)
        except (OSError, ValueError, KeyError):
            ok = False
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    ok = ok and "Traceback" not in p.stderr and (p.returncode == 0 or len(lines) == 1)
    return p.returncode, lines, left, ok


def mount_ok() -> bool:
    if os.geteuid() != 0:
        return False
    with tempfile.TemporaryDirectory() as d:
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", d], capture_output=True).returncode:
            return False
        subprocess.run(["umount", d], check=True)
        return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="12,16,20,24,28,32,36,40,44,48,56,64,128,600")
    a = ap.parse_args()
    sizes = [int(x) for x in a.sizes.split(",")]
    tmpfs = mount_ok()
    print(f"{'case':<28} {'exit':>4} {'stderr lines':>12} {'left':<40} verdict  message")
    bad = 0
    with tempfile.TemporaryDirectory() as d:
        cases = [(f"tmpfs {kb} KB" if tmpfs else f"file size limit {kb} KB", kb) for kb in sizes]
        cases.append(("read-only tmpfs" if tmpfs else "path through a file", None))
        for name, kb in cases:
            m = os.path.join(d, "m")
            os.makedirs(m, exist_ok=True)
            limit = None
            if tmpfs:
                opts = f"size={kb}k" if kb else "size=1m,ro"
                subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", m], check=True)
                out = os.path.join(m, "run")
            elif kb:
                limit, out = kb * 1024, os.path.join(m, f"run{kb}")
            else:
                open(os.path.join(d, "afile"), "w").close()
                out = os.path.join(d, "afile", "run")
            try:
                code, lines, left, ok = run(out, limit)
            finally:
                if tmpfs:
                    subprocess.run(["umount", m], check=True)
            bad += not ok
            print(f"{name:<28} {code:>4} {len(lines):>12} {(', '.join(left) or '-'):<40} {'ok' if ok else 'BAD':<7}  "
                  f"{lines[-1] if lines else ''}")
    print(f"{len(cases)} runs, {bad} bad outcomes (a traceback, more than one line, or complete-looking files "
          "from a failed run)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
