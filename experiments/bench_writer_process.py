#!/usr/bin/env python3
"""What a trace writer in another process would cost the step loop: evidence for issue 17's item 4, not a feature.

The recorder's writer is a thread. At batch 1 on a CPU model its Python shares the GIL with the step loop's Python,
so its encoding is paid in the decode's wall time (``bench_trace.py``'s recording overhead). A writer process would
not share the GIL; what it costs the step loop is the hand-over: the step's tensors turned into bytes and piped to
the child. This script measures that lower bound on real ``dlm`` runs (the default config: the embedded model,
low_confidence), recording on against off in interleaved pairs, for two hand-overs:

* ``step``: each delta's tensors become bytes and go down the pipe as the delta arrives (the loop's thread touches
  every step's tensors);
* ``batch``: the sink only keeps the deltas; at the batch's end each field is stacked over the batch's steps (per
  window shape), turned into bytes once and piped (the loop's thread touches a batch's tensors a few times).

The child (a fresh ``python -S``) reads and discards the bytes, then reports how many it got (checked against what
was sent): a real writer would encode them there, on the other core. Left out, and printed beside the result from
their own measurement: the provenance header (``build_header``), which any recorder builds on the loop's thread,
and the encoding of a run's last batch, which a close would wait for (``bench_trace.py``'s writer section times the
encoding). CPU only (the hand-over reads tensors on the host).

    python experiments/bench_writer_process.py [--pairs 20] [--handover step,batch] [--batch-size 1] [--prompts 2]
"""
from __future__ import annotations

import argparse
import os
import statistics
import struct
import subprocess
import sys
import time
from typing import Dict, List

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import bench_trace  # noqa: E402  (a script's folder is on the import path: run as a script, or tests' load_experiment)
from dlm_engine.core.loop import Sink  # noqa: E402

HANDOVERS = ("step", "batch")
# the child: count what arrives until the pipe closes, then say how much on stdout (a line: the parent's close waits
# for that acknowledgement, as a writer's close waits for the file to be complete, not for the interpreter's exit)
CHILD = ("import os, sys\nn = 0\nwhile True:\n    b = os.read(0, 1 << 20)\n    if not b:\n        break\n"
         "    n += len(b)\nsys.stdout.write(str(n) + '\\n')\nsys.stdout.flush()\n")
_HEAD = struct.Struct("<iiiid")      # step, nfe, start, width, wall time


def _tensors(d) -> List[torch.Tensor]:
    """A delta's tensors that a writer needs (as the recorder reads them; ``finished`` is settled by sink time)."""
    out = [d.commit, d.tokens, d.active, d.finished]
    if d.confidence is not None:
        out.append(d.confidence)
    out += [v for v in d.scalars.values() if isinstance(v, torch.Tensor)]
    return out


class StepHandover(Sink):
    """Every delta's tensors to bytes and down the pipe as it arrives."""

    def __init__(self, stat: Dict[str, float], fd: int):
        self.stat, self.fd = stat, fd

    def on_delta(self, d, canvas) -> None:
        c = time.thread_time()
        ts = _tensors(d)
        parts = [_HEAD.pack(d.step, d.nfe, d.start, d.commit.shape[1], d.wall_time)]
        parts += [t.numpy().tobytes() for t in ts]
        b = b"".join(parts)
        os.write(self.fd, len(b).to_bytes(4, "little") + b)
        self.stat["tensor_bytes"] += sum(t.numel() * t.element_size() for t in ts)
        self.stat["sent"] += 4 + len(b)
        self.stat["loop_cpu"] += time.thread_time() - c
        self.stat["steps"] += 1


class BatchHandover(Sink):
    """The deltas kept; at the batch's end every field stacked over the steps of one window shape, sent once."""

    def __init__(self, stat: Dict[str, float], fd: int):
        self.stat, self.fd, self.deltas = stat, fd, []

    def on_delta(self, d, canvas) -> None:
        self.deltas.append(d)
        self.stat["steps"] += 1

    def on_end(self, canvas) -> None:
        c = time.thread_time()
        groups: Dict[tuple, list] = {}
        for d in self.deltas:
            key = tuple(tuple(t.shape) + (str(t.dtype),) for t in _tensors(d))
            groups.setdefault(key, []).append(d)
        parts = []
        for ds in groups.values():
            parts.append(np.array([(d.step, d.nfe, d.start, d.commit.shape[1]) for d in ds], dtype=np.int32).tobytes())
            parts.append(np.array([d.wall_time for d in ds], dtype=np.float64).tobytes())
            for field in zip(*(_tensors(d) for d in ds)):
                s = torch.stack(field)
                parts.append(s.numpy().tobytes())
                self.stat["tensor_bytes"] += s.numel() * s.element_size()
        b = b"".join(parts)
        os.write(self.fd, len(b).to_bytes(4, "little") + b)
        self.stat["sent"] += 4 + len(b)
        self.deltas = []
        self.stat["loop_cpu"] += time.thread_time() - c
        self.stat["batches"] += 1


def new_stat() -> Dict[str, float]:
    """The hand-over's counters, summed over runs: bytes piped (and of them, tensor bytes), the loop thread's CPU in
    the sinks, at the child's start and at close, close's wall time, steps and batches handed over."""
    return dict(sent=0, tensor_bytes=0, loop_cpu=0.0, open_cpu=0.0, close_cpu=0.0, close_wall=0.0, steps=0, batches=0)


def run_once(handover, cfg, ms, mc, lm, ids, stat):
    """Wall seconds of one run: no recording (``handover`` None), or with a child process and its hand-over. With
    one, the child's count of the bytes it got must equal what was sent."""
    from dlm_engine.app.api import run_prompts

    torch.manual_seed(cfg.seed)
    t0 = time.perf_counter()
    sinks, child, sent0 = None, None, stat["sent"]
    if handover is not None:
        c = time.thread_time()
        child = subprocess.Popen([sys.executable, "-S", "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        fd = child.stdin.fileno()
        kind = StepHandover if handover == "step" else BatchHandover
        sinks = lambda b, rows: [kind(stat, fd)]        # noqa: E731
        stat["open_cpu"] += time.thread_time() - c
    try:
        run_prompts(lm, ids, ms, mc, cfg.gen_length, cfg.batch_size, sinks_for_batch=sinks, warmup=False)
    except BaseException:
        if child is not None:              # (no child left waiting on a pipe nobody will close)
            child.communicate()
        raise
    if child is None:
        return time.perf_counter() - t0
    c, w = time.thread_time(), time.perf_counter()
    child.stdin.close()
    got = int(child.stdout.readline() or 0)
    stat["close_cpu"] += time.thread_time() - c
    stat["close_wall"] += time.perf_counter() - w
    wall = time.perf_counter() - t0
    child.stdout.close()
    child.wait()                       # (the child's exit: outside the run's time, as a writer process would outlive it)
    if got != stat["sent"] - sent0:
        raise AssertionError(f"the child got {got} bytes, {stat['sent'] - sent0} were sent")
    return wall


def measure(handover: str, pairs: int, cfg, ms, mc, lm, ids) -> Dict[str, float]:
    """Interleaved on/off pairs (on first in even pairs) after one warm-up pair; the median and quartiles of the
    on/off wall ratios, and the hand-over's costs per run."""
    run_once(handover, cfg, ms, mc, lm, ids, new_stat()), run_once(None, cfg, ms, mc, lm, ids, new_stat())
    stat = new_stat()
    ratios, off = [], []
    for i in range(pairs):
        order = (handover, None) if i % 2 == 0 else (None, handover)
        got = {h: run_once(h, cfg, ms, mc, lm, ids, stat) for h in order}
        ratios.append(got[handover] / got[None])
        off.append(got[None])
    q = np.percentile(ratios, [25, 50, 75])
    res = {k: v / pairs for k, v in stat.items()}      # per run
    res.update(median=float(q[1]), q1=float(q[0]), q3=float(q[2]), off_wall=statistics.median(off))
    return res


def header_cpu(cfg, lm, ids, n: int = 10) -> float:
    """CPU seconds of one provenance header (``build_header``), as any recorder builds it on the loop's thread."""
    from dlm_engine.trace.runtime import build_header

    build_header(cfg, lm, rows_expected=len(ids), prompt_length=max(len(p) for p in ids))
    c = time.thread_time()
    for _ in range(n):
        build_header(cfg, lm, rows_expected=len(ids), prompt_length=max(len(p) for p in ids))
    return (time.thread_time() - c) / n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=20)
    ap.add_argument("--handover", default="step,batch", help="comma list of: " + ", ".join(HANDOVERS))
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--gen-length", type=int, default=48)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: the child has a core)")
    args = ap.parse_args(argv)
    kinds = [h for h in args.handover.split(",") if h]
    bad = [h for h in kinds if h not in HANDOVERS]
    if bad or not kinds:
        ap.error(f"--handover={args.handover}: choose from {', '.join(HANDOVERS)}")
    for name in ("pairs", "batch_size", "prompts", "gen_length", "threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be a positive integer")
    from dlm_engine.core.memory import keep_freed_memory

    keep_freed_memory()
    torch.set_num_threads(args.threads)
    cfg, ms, mc, lm, inputs = bench_trace.load_default([f"gen_length={args.gen_length}",
                                                       f"batch_size={args.batch_size}", "device=cpu"])
    ids = (inputs["ids"] * (1 + args.prompts // max(1, len(inputs["ids"]))))[:args.prompts]
    head = header_cpu(cfg, lm, ids)
    print(f"writer-process hand-over: {lm.name}, batch {args.batch_size}, {len(ids)} prompts, gen_length "
          f"{args.gen_length}, {cfg.strategy.name}, {args.threads} torch thread(s); {args.pairs} interleaved on/off "
          f"pairs; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    for h in kinds:
        r = measure(h, args.pairs, cfg, ms, mc, lm, ids)
        per = (f"{r['loop_cpu'] / max(r['steps'], 1e-9) * 1e6:.1f} us/step" if h == "step"
               else f"{r['loop_cpu'] / max(r['batches'], 1e-9) * 1e3:.2f} ms/batch")
        print(f"{h:>5}: wall median pair ratio {100 * (r['median'] - 1):+.2f}% (IQR {100 * (r['q1'] - 1):+.2f}.."
              f"{100 * (r['q3'] - 1):+.2f}%, target <= +1%); off run {r['off_wall'] * 1e3:.0f} ms")
        print(f"       loop's thread: hand-over {per} ({r['loop_cpu'] * 1e3:.2f} ms/run), child start "
              f"{r['open_cpu'] * 1e3:.2f} ms CPU/run, close {r['close_cpu'] * 1e3:.2f} ms CPU / "
              f"{r['close_wall'] * 1e3:.2f} ms wall per run; {r['sent'] / 1e3:.1f} KB/run piped "
              f"({r['tensor_bytes'] / 1e3:.1f} KB of tensors), all received")
    print(f"not included above: the provenance header, {head * 1e3:.2f} ms CPU a run on the loop's thread "
          f"({100 * head / r['off_wall']:.2f}% of the off run), and the child's encoding of the last batch, which a "
          "close would wait for")
    return 0


if __name__ == "__main__":
    sys.exit(main())
