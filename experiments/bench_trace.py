"""Trace recorder benchmark: size, replay speed and recording overhead against docs/specs/trace.md's targets.

    .venv/bin/python experiments/bench_trace.py            # everything (a few minutes on 2 CPU cores)
    .venv/bin/python experiments/bench_trace.py --quick    # fewer sizes and pairs

1. Bytes per generated token of synthetic trajectories shaped like real ones (V = 126,464; L in
   {64,128,256,1024,2048}; T in {32,64,128}; block-wise and threshold-style schedules; Zipf tokens with a
   frequency-ordered vocabulary as BPE vocabularies roughly are, and with a random id permutation as the
   worst case). "trajectory" = the framed per-sequence record (final tokens + step_of, lossless);
   "+conf" = extra bytes of float16 confidences; "steps" = the per-step records (NFE, wall time, window,
   active/finished, scalars) of a batch of 1, and per token of a batch of 8.
2. Replay to the final output from the record's bytes (CRC check + decode) and state at a step once decoded.
3. Real traces of the default model (the file as written by ``dlm``).
4. Recording overhead: the same decode run with recording on and off, alternated, median of >= 10 pairs;
   the on-run includes the recorder's start, encoding, the end record, fsync and rename.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402

from dlm_engine.trace import format as fmt  # noqa: E402

V = 126_464
TARGET_128 = 3.5
TARGET_LONG = 2.5
TARGET_CONF = 2.0


# --------------------------------------------------------------------------------------------------
# synthetic trajectories
def zipf_sampler(rng, s=1.1, permuted=False):
    p = np.arange(1, V + 1, dtype=np.float64) ** -s
    cdf = np.cumsum(p / p.sum())
    perm = rng.permutation(V) if permuted else None

    def draw(n):
        r = np.searchsorted(cdf, rng.random(n))
        r = np.minimum(r, V - 1)
        return perm[r] if perm is not None else r
    return draw


def blockwise_schedule(rng, L, T):
    """LLaDA-style: blocks left to right, a fixed number of commits per step inside the current block."""
    nb = max(1, min(L // 32, T))
    bl, spb = L // nb, T // nb
    so = np.zeros(L, dtype=np.int64)
    for b in range(nb):
        k = np.full(spb, bl // spb)
        k[: bl % spb] += 1
        steps = np.repeat(np.arange(spb), k)
        so[b * bl + rng.permutation(bl)] = b * spb + steps + 1
    return so


def threshold_schedule(rng, L, T):
    """Threshold-style: a variable number of commits per step, near the leftmost masked positions."""
    so = np.full(L, -1, dtype=np.int64)
    ks = rng.multinomial(L - T, np.ones(T) / T) + 1
    for t, k in enumerate(ks):
        rem = np.flatnonzero(so < 0)
        cand = rem[: max(int(k) * 2, 16)]
        so[rng.choice(cand, size=int(k), replace=False)] = t + 1
    return so


def synthetic_seq(rng, draw, L, T, sched, row=0):
    so = blockwise_schedule(rng, L, T) if sched == "block" else threshold_schedule(rng, L, T)
    tok = draw(L)
    conf = np.clip(1.0 - rng.beta(0.6, 4.0, size=L), 1e-3, 1.0).astype(np.float32)
    return fmt.SeqData(row=row, tokens=tok, step_of=so, nfe=T, confidence=conf)


def steps_record(rng, T, B):
    """A realistic STEPS record of one batch (what the recorder writes per 64 steps)."""
    wall_us = np.rint(np.cumsum(rng.normal(0.004, 0.0003, T)) * 1e6).astype(np.int64)
    arrays = {"wall_dus": np.diff(wall_us, prepend=0), "nfe": np.ones(T, np.int32), "start": np.full(T, 100, np.int32),
              "width": np.full(T, 32, np.int32), "active": np.ones((T, B), bool),
              "finished": np.arange(T)[:, None] >= T - 1 + np.zeros((1, B), int),
              "s:block": (np.arange(T) // 8).astype(np.int64), "s:committed": np.full((T, B), 2, np.int64)}
    total = 0
    for c in range(0, T, 64):
        meta = {"batch": 0, "first": c, "n": min(64, T - c), "events": [], "json_scalars": {}, "step0": c + 1}
        part = {k: v[c:c + 64] for k, v in arrays.items()}
        total += len(fmt.frame_record(fmt.STEPS, fmt.encode_bundle(meta, part)))
    return total


def bench_sizes(quick):
    rng = np.random.default_rng(0)
    draws = {"zipf": zipf_sampler(rng), "zipf-perm": zipf_sampler(rng, permuted=True)}
    Ls = [64, 128, 256, 1024, 2048] if not quick else [128, 1024]
    Ts = [32, 64, 128] if not quick else [64]
    print("\n== bytes per generated token, synthetic trajectories (V=126,464; mean of 8 sequences) ==")
    print(f"{'L':>5} {'T':>4} {'schedule':>9} {'tokens':>9} | {'trajectory':>10} {'target':>6} {'ok':>3} | "
          f"{'+conf':>6} {'ok':>3} | {'steps B=1':>9} {'steps B=8':>9}")
    worst = {}
    for L in Ls:
        for T in Ts:
            if T > L:
                continue
            for sched in ("block", "threshold"):
                for tname, draw in draws.items():
                    traj, conf = [], []
                    for r in range(8):
                        s = synthetic_seq(rng, draw, L, T, sched, r)
                        conf_bytes = len(fmt.frame_record(fmt.SEQ, fmt.encode_seq(s)))
                        s.confidence = None
                        tb = len(fmt.frame_record(fmt.SEQ, fmt.encode_seq(s)))
                        traj.append(tb / L)
                        conf.append((conf_bytes - tb) / L)
                    t, c = float(np.mean(traj)), float(np.mean(conf))
                    target = TARGET_128 if L <= 128 else (TARGET_LONG if L >= 1024 else None)
                    ok = "-" if target is None else ("yes" if t <= target else "NO")
                    s1, s8 = steps_record(rng, T, 1) / L, steps_record(rng, T, 8) / (8 * L)
                    print(f"{L:>5} {T:>4} {sched:>9} {tname:>9} | {t:>10.3f} {target if target else '':>6} {ok:>3} | "
                          f"{c:>6.3f} {'yes' if c <= TARGET_CONF else 'NO':>3} | {s1:>9.3f} {s8:>9.3f}")
                    worst[(L, T, sched, tname)] = (t, c)
    return worst


# --------------------------------------------------------------------------------------------------
def timeit(fn, n):
    """Best of 5 batches of ``n`` calls: (wall seconds per call, CPU seconds per call of this thread).

    CPU time is reported too because this 2-core machine is shared: wall time includes waiting for a core.
    """
    for _ in range(min(50, n)):
        fn()
    walls, cpus = [], []
    for _ in range(5):
        c0, t0 = time.thread_time(), time.perf_counter()
        for _ in range(n):
            fn()
        walls.append((time.perf_counter() - t0) / n)
        cpus.append((time.thread_time() - c0) / n)
    return min(walls), min(cpus)


def bench_replay():
    rng = np.random.default_rng(1)
    draw = zipf_sampler(rng)
    a = np.arange(128)
    ref = timeit(lambda: np.cumsum(a), 5000)
    print("\n== replay and random access (best of 5 x n calls; wall / CPU time of the calling thread) ==")
    print(f"calibration: one np.cumsum over 128 int64 takes {ref[0] * 1e6:.2f} / {ref[1] * 1e6:.2f} us here "
          f"(about 0.5-1 us on an idle core); load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"{'L':>5} {'T':>4} | {'replay from record bytes':>26} {'target':>6} | {'state_at(t)':>18} {'target':>6} | "
          f"{'whole 1-seq file':>20}")
    out = {}
    for L, T in ((128, 64), (1024, 64), (2048, 128)):
        s = synthetic_seq(rng, draw, L, T, "block")
        s.confidence = None
        rec = fmt.frame_record(fmt.SEQ, fmt.encode_seq(s))
        H = fmt.REC_HEAD.size

        def replay():
            kind, ln, crc = fmt.REC_HEAD.unpack_from(rec, 0)
            payload = rec[H:H + ln]
            if fmt.record_crc(kind, rec[:5], payload) != crc:
                raise AssertionError
            return fmt.decode_seq(payload).tokens

        assert np.array_equal(replay(), s.tokens)
        t_replay = timeit(replay, 2000 if L <= 128 else 300)
        from dlm_engine.trace.reader import Sequence

        d = fmt.decode_seq(rec[H:])

        class _B:
            mask_id, gen_start = 126_336, 0
        seq = Sequence.__new__(Sequence)
        seq._data, seq.batch, seq._key = d, _B(), None
        seq.state_at(0)
        t_state = timeit(lambda: seq.state_at(T // 2), 5000)
        # the same sequence as a complete trace file (header, batch, sequence, batch-end, end records)
        data = _one_seq_file(s)
        from dlm_engine.trace import loads

        def whole():
            return loads(data)[0].tokens

        assert np.array_equal(whole(), s.tokens)
        t_file = timeit(whole, 200)
        us = lambda x: f"{x[0] * 1e6:.1f} / {x[1] * 1e6:.1f} us"  # noqa: E731
        print(f"{L:>5} {T:>4} | {us(t_replay):>26} {'50 us' if L == 128 else '':>6} | {us(t_state):>18} {'10 us':>6} | "
              f"{us(t_file):>20}")
        out[L] = (t_replay, t_state, t_file)
    return out


def _one_seq_file(s):
    """A complete one-sequence trace (header, batch, steps, sequence, batch-end, end) that passes every check."""
    import hashlib
    import json

    T, L = int(s.step_of.max()), len(s.tokens)
    parts = [fmt.PREAMBLE, fmt.frame_record(fmt.HEADER, fmt.zc(json.dumps({"model": {"eos_id": None}}).encode()))]
    parts.append(fmt.frame_record(fmt.BATCH, fmt.encode_bundle(
        {"batch": 0, "rows": [0], "gen_start": 0, "length": L, "mask_id": 126_336},
        {"prompt_tokens": np.zeros((1, 0), np.int64), "prompt_mask": np.zeros((1, 0), bool)})))
    fin = np.zeros((T, 1), bool)
    fin[s.finish_step - 1:] = s.finish_step >= 1
    parts.append(fmt.frame_record(fmt.STEPS, fmt.encode_bundle(
        {"batch": 0, "first": 0, "n": T, "events": [], "json_scalars": {}, "step0": 1},
        {"wall_dus": np.full(T, 10, np.int64), "nfe": np.ones(T, np.int32), "start": np.zeros(T, np.int32),
         "width": np.full(T, L, np.int32), "active": np.ones((T, 1), bool), "finished": fin})))
    parts.append(fmt.frame_record(fmt.SEQ, fmt.encode_seq(s)))
    parts.append(fmt.frame_record(fmt.BATCH_END, fmt.encode_bundle(
        {"batch": 0, "steps": T, "nfe": T, "wall_time": T * 1e-5, "mismatch": False, "rows": [0]})))
    body = b"".join(parts)
    parts.append(fmt.frame_record(fmt.END, fmt.encode_bundle({
        "status": "complete", "records": {"header": 1, "batch": 1, "steps": 1, "sequence": 1, "batch-end": 1},
        "unfinished_batches": [], "bytes_before_end": len(body), "sha256_before_end": hashlib.sha256(body).hexdigest()})))
    return b"".join(parts)


# --------------------------------------------------------------------------------------------------
# the default model: real traces and recording overhead
def default_config(overrides):
    from hydra import compose, initialize_config_module

    from dlm_engine.app.config import register_configs
    from dlm_engine.core.registry import load_plugins

    load_plugins()
    register_configs()
    with initialize_config_module(config_module="dlm_engine.conf", version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def load_default(extra):
    from dlm_engine.app.run import load_inputs, validate
    from dlm_engine.app.api import load_model

    try:
        cfg = default_config(extra)
        ms, mc = validate(cfg)
        lm = load_model(cfg.model, cfg.device, cfg.dtype)
        inputs = load_inputs(cfg, lm)
    except Exception as exc:  # no embedded checkpoint (partial checkout), or its 64-position context is too short
        gen = int(default_config(extra).gen_length)
        print(f"(default model cannot run this: {exc}; using model=tiny_random with a {gen + 64}-position context)")
        cfg = default_config(["model=tiny_random", f"model.random.max_sequence_length={gen + 64}"]
                             + [o for o in extra if not o.startswith("task")])
        ms, mc = validate(cfg)
        lm = load_model(cfg.model, cfg.device, cfg.dtype)
        inputs = load_inputs(cfg, lm)
    return cfg, ms, mc, lm, inputs


def bench_real(quick):
    import torch

    from dlm_engine.app.api import run_prompts
    from dlm_engine.trace import open_trace
    from dlm_engine.trace.runtime import open_run_recorder

    print("\n== real traces of the default model (file as written by dlm; header excluded from per-token figures) ==")
    print(f"{'model':>12} {'L':>5} {'steps':>5} {'rows':>5} | {'traj B/pos':>10} {'traj B/gen tok':>14} | "
          f"{'file B/pos':>10} {'header B':>8} | capture")
    tmp = tempfile.mkdtemp(prefix="bench-trace-")
    for L in ((32, 64) if quick else (32, 64, 128)):
        for capture in ("tokens", "confidence"):
            cfg, ms, mc, lm, inputs = load_default([f"gen_length={L}", f"trace.capture={capture}", "batch_size=8"])
            cfg.trace.filename = f"real_{L}_{capture}.dlmt"
            torch.manual_seed(cfg.seed)
            rec = open_run_recorder(cfg, tmp, lm, inputs["ids"])
            with rec:
                run_prompts(lm, inputs["ids"], ms, mc, cfg.gen_length, cfg.batch_size,
                            sinks_for_batch=lambda b, rows: [rec.sink(b, rows)], warmup=False)
            tr = open_trace(rec.path, recover=False)
            seq_bytes = sum(len(r.payload) + fmt.REC_HEAD.size for r in tr.records if r.kind == fmt.SEQ)
            head = len(tr.records[0].payload) + fmt.REC_HEAD.size + len(fmt.PREAMBLE)
            pos = sum(s.gen_length for s in tr)
            gen = sum(s.generated_tokens() for s in tr)
            print(f"{lm.name:>12} {L:>5} {max(s.n_steps for s in tr):>5} {len(tr):>5} | {seq_bytes / pos:>10.3f} "
                  f"{seq_bytes / gen:>14.3f} | {(tr.size - head) / pos:>10.3f} {head:>8} | {capture}")


def bench_overhead(pairs, gen_length, n_prompts):
    import torch

    from dlm_engine.app.api import run_prompts
    from dlm_engine.trace.runtime import open_run_recorder

    cfg, ms, mc, lm, inputs = load_default([f"gen_length={gen_length}", "batch_size=8"])
    ids = (inputs["ids"] * (1 + n_prompts // max(1, len(inputs["ids"]))))[:n_prompts]
    tmp = tempfile.mkdtemp(prefix="bench-trace-")

    from dlm_engine.trace import recorder as R

    chan = R._Channel(1 << 30)   # the bare hand-over, measured before the sink methods are instrumented
    probe = R.BatchSink(type("R", (), {"wants_logits": False, "_put": lambda self, item: chan.put(item)})(), 0, [0])
    bare = timeit(lambda: probe.on_delta(None, None), 20000)[1]
    acc = {"handover": 0.0, "open_close": 0.0, "writer": 0.0, "steps": 0, "runs": 0}
    for name in ("on_start", "on_delta", "on_end"):
        orig = getattr(R.BatchSink, name)

        def timed(self, *args, _orig=orig, _name=name):
            c = time.thread_time()
            _orig(self, *args)
            acc["handover"] += time.thread_time() - c
            acc["steps"] += _name == "on_delta"
        setattr(R.BatchSink, name, timed)

    def one(record: bool):
        torch.manual_seed(cfg.seed)
        c0, t0 = time.process_time(), time.perf_counter()
        if record:
            c = time.thread_time()
            rec = open_run_recorder(cfg, tmp, lm, ids)
            acc["open_close"] += time.thread_time() - c
            run_prompts(lm, ids, ms, mc, cfg.gen_length, cfg.batch_size,
                        sinks_for_batch=lambda b, rows: [rec.sink(b, rows)], warmup=False)
            c = time.thread_time()
            rec.close()
            acc["open_close"] += time.thread_time() - c
            acc["writer"] += rec.writer_cpu
            acc["runs"] += 1
        else:
            run_prompts(lm, ids, ms, mc, cfg.gen_length, cfg.batch_size, warmup=False)
        return time.perf_counter() - t0, time.process_time() - c0

    one(True), one(False)   # warm-up (imports, git provenance, allocator)
    for k in acc:
        acc[k] = 0
    ratios, cpu_ratios, ons, offs = [], [], [], []
    for i in range(pairs):
        if i % 2 == 0:
            on, off = one(True), one(False)
        else:
            off, on = one(False), one(True)
        ons.append(on[0])
        offs.append(off[0])
        ratios.append(on[0] / off[0])
        cpu_ratios.append(on[1] / off[1])
    med, cmed = statistics.median(ratios), statistics.median(cpu_ratios)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"\n== recording overhead: {lm.name}, {len(ids)} prompts, gen_length {gen_length}, batch 8, "
          f"{cfg.strategy.name}; {pairs} alternated pairs; load average {load:.1f} on {os.cpu_count()} CPUs ==")
    print(f"wall: median off {statistics.median(offs) * 1e3:.1f} ms, on {statistics.median(ons) * 1e3:.1f} ms, "
          f"median pair ratio on/off {med:.4f} (overhead {100 * (med - 1):+.2f}%, target <= +1%)  "
          f"[pair ratios {min(ratios):.3f}..{max(ratios):.3f}]")
    print(f"CPU time of the process (all threads, writer included): median pair ratio {cmed:.4f} "
          f"(overhead {100 * (cmed - 1):+.2f}%)  [pair ratios {min(cpu_ratios):.3f}..{max(cpu_ratios):.3f}]")
    n, st = max(1, acc["runs"]), max(1, acc["steps"])
    off_ms = statistics.median(offs) * 1e3
    cost_ms = (acc["handover"] + acc["open_close"] + acc["writer"]) / n * 1e3
    print(f"bare hand-over of one delta (queue put): {bare * 1e6:.2f} us CPU")
    print(f"CPU spent on recording per run (thread clocks, insensitive to other load): hand-over in the step loop "
          f"(incl. per-batch snapshots and this probe's clock calls) {acc['handover'] / st * 1e6:.1f} us/step, writer thread {acc['writer'] / st * 1e6:.1f} us/step, "
          f"open + close (header, end record, fsync, rename) {acc['open_close'] / n * 1e3:.2f} ms/run; "
          f"total {cost_ms:.2f} ms = {100 * cost_ms / off_ms:.2f}% of the median recording-off wall time")
    return med


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--pairs", type=int, default=12)
    ap.add_argument("--gen-length", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--skip", default="", help="comma list of sections to skip: sizes,replay,real,overhead")
    a = ap.parse_args()
    skip = set(filter(None, a.skip.split(",")))
    import torch

    torch.set_num_threads(min(2, os.cpu_count() or 1))
    if "sizes" not in skip:
        bench_sizes(a.quick)
    if "replay" not in skip:
        bench_replay()
    if "real" not in skip:
        bench_real(a.quick)
    if "overhead" not in skip:
        bench_overhead(max(10, a.pairs if not a.quick else 10), a.gen_length, a.prompts)


if __name__ == "__main__":
    main()
