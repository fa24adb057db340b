#!/usr/bin/env python3
"""Framework overhead per strategy x cache x batch: CPU time outside the model forward, per-section CPU per
step (plan / sample / select / apply / sinks), host synchronisations and tensor operations (kernel launches on
a GPU) per step outside the model, next to the budgets of issue
17 (overhead <= 10% on the embedded model and <= 3% on a LLaDA-shaped d256 x 4-layer model at batch 1; at most
one host sync per step outside the model).

    python experiments/bench_overhead.py [--model tiny|d256|both] [--batches 1,8] [--prompts 8] [--repeats 3]

Torch runs on one thread (``torch.set_num_threads(1)``) so that CPU time is a fair measure of work. Decode CPU
time is the thread's CPU time over the whole decode; model CPU time is the same clock inside the model's
forward; the overhead is their difference over the decode time (the smallest outside-the-model and model times
of ``--repeats`` plain runs: a VM's steal time only ever adds). Per-section times and syncs come from one
instrumented run each. Syncs are counted by
wrapping the tensor operations that force a host-device synchronisation (``dlm_engine.core.instrument``).

``--replayed`` adds ``loop us/st`` (cache ``none``): the CPU outside the model per step when the model's forwards
are replayed from a first recording run (:class:`ReplayedForwards`; the replayed decodes are checked to make the
same tokens). Without the model's work between steps the loop runs with warm CPU caches, so this is lower than the
plain figure, but it varies far less from run to run: use it to compare changes to the loop itself.
``--evict-mb N`` (with ``--replayed``) adds ``evicted us/st``: the same replayed loop with N MB streamed through the
caches before every forward, as the model's weights are (how much of the plain figure is the loop running on caches
the forward emptied). ``--between sleep:MS`` or ``spin:MS`` (with ``--replayed``) adds ``sleep us/st`` or ``spin us/st``: the replayed loop
with the thread sleeping, or spinning in a bare Python loop, MS ms before every forward instead (no data streamed):
how much of the plain figure the forward's time alone costs the loop, whatever fills it.
``--plain`` decodes with ``fast=False`` (the plain path: :mod:`dlm_engine.core.fast`'s shortcuts off) to measure
what the fast layer pays. ``--record`` attaches a trace recorder to every decode, as a ``dlm`` run does; the ``sinks``
column is the step loop's hand-over to it. ``--ops-detail N`` prints under each row its N most expensive tensor
operations outside the model, per step: CPU, count, op and the framework line that made it
(:class:`dlm_engine.core.instrument.OpProfile`, one more instrumented run).
"""
from __future__ import annotations

import argparse
import dataclasses
import contextlib
import os
import shutil
import sys
import tempfile
import time
from typing import Optional, Tuple

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from dlm_engine.core.canvas import Canvas  # noqa: E402
from dlm_engine.core.capabilities import incompatibility  # noqa: E402
from dlm_engine.core.instrument import ModelTimer, OpProfile, Sections, SyncCounter  # noqa: E402
from dlm_engine.core.loop import decode  # noqa: E402
from dlm_engine.core.registry import cache_class, load_plugins, strategy_class  # noqa: E402

BETWEEN_KINDS = ("sleep", "spin")     # --between: what fills a replayed forward's time


def between_ok(between: Tuple[str, float]) -> bool:
    """A ``--between`` setting ``(kind, ms)`` the replayed loop takes: a kind of ``BETWEEN_KINDS``, 0-1000 ms."""
    return between[0] in BETWEEN_KINDS and 0 <= between[1] <= 1000

# (label, strategy, config overrides, caches to try)
SETTINGS = [
    ("low_conf", "low_confidence", {}, ("none", "dual")),
    ("threshold", "threshold", {}, ("none", "dual")),
    ("factor", "factor", {}, ("none",)),
    ("cadllm", "cadllm", {}, ("dual",)),
    ("early_exit", "early_exit", {"answer_start": 0}, ("none",)),
    ("block_buffer", "block_buffer", {}, ("none",)),
    ("d2c", "d2c", {}, ("none", "dual")),
    ("d2c thr", "d2c", {"threshold": 0.9}, ("none",)),
    ("pc_sampler", "d2c", {"debias": True, "freq_table": "llada"}, ("none",)),
    ("eb_sampler", "d2c", {"gamma": 0.001}, ("none",)),
    ("cert_prior", "d2c", {"sigma": 10.0}, ("none",)),
    ("klass", "klass", {"threshold": 0.9}, ("none",)),
    ("ar", "ar", {"threshold": 0.9}, ("none",)),
    ("wino", "wino", {}, ("none",)),
]


def models(which, device="cpu", dtype="float32"):
    from dlm_engine.checkpoints import embedded_path
    from dlm_engine.models.loader import build_random, load_pretrained

    out = []
    if which in ("tiny", "both"):
        m = load_pretrained(embedded_path("tiny"), device=device, dtype=dtype)[0]
        out.append(("tiny", m, 16, 16, [[5 + (i % 40), 6, 7, 8, 9, 10] for i in range(64)], 10.0))
    if which in ("d256", "both"):
        cfg = dict(d_model=256, n_heads=4, n_layers=4, mlp_hidden_size=768, vocab_size=4096, embedding_size=4096,
                   mask_token_id=4000, eos_token_id=4001, pad_token_id=4001, max_sequence_length=512)
        m = build_random(cfg, seed=0, device=device, dtype=dtype)[0]
        out.append(("d256", m, 128, 32, [[5 + i] * 16 for i in range(64)], 3.0))
    return out


def open_recorder(model, prompts, gen, batch):
    """A trace recorder for one ``one`` call (a file in a fresh temporary directory), as ``dlm`` records a run:
    default capture, its header's shape facts from the model and the prompts."""
    from dlm_engine.trace.recorder import TraceRecorder

    cfg = model.config
    V = int(getattr(cfg, "embedding_size", None) or cfg.vocab_size)
    header = {"model": {"name": "bench", "eos_id": int(cfg.eos_token_id), "mask_id": int(cfg.mask_token_id),
                        "vocab_size": V},
              "shape": {"vocab_size": V, "batch_size": batch, "gen_length": gen,
                        "prompt_length": max(len(p) for p in prompts)}}
    return TraceRecorder(os.path.join(tempfile.mkdtemp(prefix="bench-overhead-"), "run.dlmt"), header)


def one(model, prompts, gen, name, kw, cache, batch, instrument=("sections", "syncs"), record=False):
    """Decode ``prompts`` in batches; returns (decode cpu, model cpu, steps, syncs, sections, decodes, ops).

    ``instrument``: which of the section timers, the sync counter and the op profile (``"ops"``, left in
    ``one.profile``) to run (each costs CPU of its own -- the counter and the profile see every tensor op -- so the
    overhead figure comes from plain runs, and sections, syncs and ops from one run each). ``record``: every
    batch's deltas also go to a trace recorder's sink, as in a ``dlm`` run (its hand-over is on the step loop's
    thread and counted; the writer thread's encoding is not)."""
    cls = strategy_class(name)
    rec = open_recorder(model, prompts, gen, batch) if record else None
    timer = ModelTimer(model)
    dev = next(model.parameters()).device
    cpu = wall = 0.0
    steps = 0
    syncs = decodes = 0
    sections = Sections()
    profile = OpProfile(timer)
    ops = 0
    tokens = []
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        strategy = cls(cls.Config(**kw), gen)
        canvas = Canvas.from_prompts(chunk, gen, int(model.config.mask_token_id), 0, device=dev)
        counter = SyncCounter(timer)
        sinks = [rec.sink(decodes, list(range(i, i + len(chunk))))] if rec is not None else []
        with torch.inference_mode(), \
                (sections.around(strategy, sinks) if "sections" in instrument else contextlib.nullcontext()), \
                (counter if "syncs" in instrument else contextlib.nullcontext()), \
                (profile if "ops" in instrument else contextlib.nullcontext()):
            w0, t0 = time.perf_counter(), time.thread_time()
            decode(timer, canvas, strategy, cache_class(cache)(), sinks=sinks, fast=not one.plain)
            cpu += time.thread_time() - t0
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            wall += time.perf_counter() - w0
        steps += canvas.step
        tokens.append(canvas.tokens.tolist())
        syncs += counter.total
        ops += counter.ops
        decodes += 1
    if rec is not None:
        rec.close()
        shutil.rmtree(os.path.dirname(rec.path), ignore_errors=True)
    one.wall = wall                    # (wall seconds of the last call, the device's queue drained)
    one.profile = profile              # (the last call's op profile: empty unless "ops" was instrumented)
    one.tokens = tokens                # (the last call's final tokens, per decode)
    return cpu, timer.cpu, steps, syncs, sections.cpu, decodes, ops


one.plain = False      # --plain: decode(..., fast=False), the plain path without the fast layer's shortcuts


class ReplayedForwards:
    """A model whose forwards are replayed: the first call with given inputs runs the model, an identical later
    call returns a copy of that call's result. A decode's CPU outside the model then comes without the model's
    work between steps (which evicts the loop's code and data from the CPU caches: this is the loop's own cost,
    warm, a lower bound) and with far less run-to-run noise, so that small changes to the loop can be compared.
    Cache ``none`` only: a cache's hooks run inside the forward and keep state."""

    def __init__(self, model, evict_mb: int = 0, between: Optional[Tuple[str, float]] = None):
        self.model, self.store = model, {}
        # ``between = (kind, ms)``: before every replayed forward (timed as the model), ``sleep`` that long (the
        # thread idle, no work at all) or ``spin`` in a bare Python loop (other code run, no data streamed): what
        # the passage of a forward's time, rather than the forward's own data, leaves cold for the loop
        if between is not None and not between_ok(between):
            raise ValueError(f"between={between}: a kind of {', '.join(BETWEEN_KINDS)} and 0-1000 ms")
        self.between = between
        # ``evict_mb``: stream a buffer this large through the caches before every replayed forward (timed as the
        # model, like the forward it stands for), as the model's weights and activations do: the loop then runs
        # after its code and data were evicted, and its CPU a step shows how much of the plain figure is that
        self.evict = torch.zeros(evict_mb * (1 << 18)) if evict_mb > 0 else None

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, ids, **kw):
        if self.evict is not None:
            self.evict.add_(1.0)
        if self.between is not None:
            kind, ms = self.between
            if kind == "sleep":
                time.sleep(ms / 1e3)
            else:
                until = time.perf_counter() + ms / 1e3
                while time.perf_counter() < until:
                    pass
        request = kw.get("request")
        if request is not None and request.aux is not None:      # extra query columns: not keyed, run them
            return self.model(ids, **kw)
        key = tuple(None if t is None else (tuple(t.shape), t.cpu().numpy().tobytes())
                    for t in (ids, kw.get("attention_mask"), kw.get("position_ids"))) + (kw.get("logits_range"),)
        call = self.store.get(key)
        if call is None:
            call = self.store[key] = self.model(ids, **kw)
            call.logits = call.logits.clone()
        return dataclasses.replace(call, logits=call.logits.clone(), memo={})


def replayed_loop_us(model, prompts, gen, name, kw, batch, repeats, evict_mb: int = 0,
                     between: Optional[Tuple[str, float]] = None):
    """``(loop us/step, same tokens)``: CPU outside the model per step with the forwards replayed (the smallest of
    ``repeats`` runs after one run that records them with the real model), and whether every replayed decode made
    the recording run's tokens. ``evict_mb``, ``between``: see :class:`ReplayedForwards`."""
    rep = ReplayedForwards(model, evict_mb, between)
    steps0 = one(rep, prompts, gen, name, kw, "none", batch, instrument=())[2]
    tokens0, best, same = one.tokens, None, True
    for _ in range(repeats):
        cpu, mcpu, steps = one(rep, prompts, gen, name, kw, "none", batch, instrument=())[:3]
        same = same and steps == steps0 and one.tokens == tokens0
        best = (cpu - mcpu) / steps * 1e6 if best is None else min(best, (cpu - mcpu) / steps * 1e6)
    return best, same


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="both", choices=("tiny", "d256", "both"))
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", default=None, help="comma-separated labels")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (on a GPU the CPU times are the host's work: "
                    "kernel launches; 'wall ms' is the decode's wall time per step, the device's queue drained)")
    ap.add_argument("--dtype", default="float32", help="float32 or bfloat16")
    ap.add_argument("--replayed", action="store_true",
                    help="also print 'loop us/st': CPU outside the model per step with the model's forwards replayed "
                         "(ReplayedForwards; cache none only), the loop's own cost without the model's noise")
    ap.add_argument("--evict-mb", type=int, default=0,
                    help="with --replayed: also print 'evicted us/st', the replayed loop's CPU a step when a buffer of "
                         "this many MB is streamed through the caches before every forward (as the model does): "
                         "between 'loop us/st' and the plain figure, it shows how much of the overhead is the loop "
                         "running on caches the forward emptied")
    ap.add_argument("--between", default=None, metavar="KIND:MS",
                    help="with --replayed: also print 'KIND us/st', the replayed loop's CPU a step when the thread "
                         "sleeps (KIND sleep: no work at all) or spins in a bare Python loop (spin: other code, no "
                         "data) for MS ms before every forward: how much of the plain figure a forward's time alone, "
                         "rather than its data, costs the loop (e.g. sleep:2)")
    ap.add_argument("--record", action="store_true",
                    help="record every decode with a trace recorder (default capture), as a `dlm` run does: the "
                         "'sinks' column is the step loop's hand-over to it; the writer thread's CPU is not counted")
    ap.add_argument("--ops-detail", type=int, default=0, metavar="N",
                    help="under each row, its N most expensive tensor ops outside the model per step (CPU, count, "
                         "op, the framework line that made it), from one more instrumented run")
    ap.add_argument("--plain", action="store_true",
                    help="decode with fast=False: the plain path, none of the fast layer's shortcuts "
                         "(dlm_engine.core.fast): run with and without it to see what the fast paths pay")
    args = ap.parse_args(argv)
    one.plain = args.plain
    from dlm_engine.core.memory import keep_freed_memory

    print(f"glibc thresholds fixed as in a dlm run (dlm_engine.core.memory): {keep_freed_memory()}")
    if args.ops_detail < 0:
        ap.error(f"--ops-detail={args.ops_detail} must be >= 0")
    if args.evict_mb and not args.replayed:
        ap.error("--evict-mb measures the replayed loop: add --replayed")
    if args.evict_mb < 0:
        ap.error(f"--evict-mb={args.evict_mb} must be >= 0")
    between = None
    if args.between is not None:
        if not args.replayed:
            ap.error("--between measures the replayed loop: add --replayed")
        kind, _, ms = args.between.partition(":")
        try:
            between = (kind, float(ms))
        except ValueError:
            between = None
        if between is None or not between_ok(between):
            ap.error(f"--between={args.between} must be KIND:MS with KIND one of {', '.join(BETWEEN_KINDS)} "
                     "and MS between 0 and 1000")
    torch.set_num_threads(1)
    load_plugins()
    only = set(args.only.split(",")) if args.only else None
    for mname, model, gen, block, prompts, budget in models(args.model, args.device, args.dtype):
        prompts = prompts[:args.prompts]
        print(f"\nmodel {mname}: gen {gen}, {len(prompts)} prompts, budget: overhead <= {budget:.0f}% at batch 1, "
              f"<= 1 sync/step (syncs/st: every host read of the decodes, a set-up read before the first step "
              f"included where one is made; the check allows two of those a decode)")
        head = (f"{'strategy':<13}{'cache':<6}{'B':>3}{'steps':>7}{'decode s':>9}{'model s':>9}{'ovh':>7}{'':>3}"
                f"{'syncs/st':>9}{'':>3}{'ops/st':>7}{'plan':>8}{'sample':>8}{'select':>8}{'apply':>8}{'sinks':>8}  (CPU ms/step)"
                f"{'wall ms':>9}" + (f"{'loop us/st':>12}" if args.replayed else "")
                + (f"{'evicted us/st':>15}" if args.replayed and args.evict_mb else "")
                + (f"{between[0] + ' us/st':>12}" if between else ""))
        print(head + "\n" + "-" * len(head))
        over, sync_over, rows_b1, fixed = [], [], 0, []
        for label, name, kw, caches in SETTINGS:
            if only and label not in only:
                continue
            kw = dict(kw)
            cls = strategy_class(name)
            if "block_length" in cls.Config.__dataclass_fields__ and name not in ("block_buffer",):
                kw.setdefault("block_length", block)
            if name == "cadllm":
                kw.update(initial_block_length=block, min_block=min(8, block), max_block=block)
            for cache in caches:
                if incompatibility(cls(cls.Config(**kw), gen), cache_class(cache)()) is not None:
                    continue
                for batch in [int(b) for b in args.batches.split(",")]:
                    if cls.max_batch == 1 and batch > 1:
                        continue
                    runs, walls = [], []
                    for _ in range(args.repeats):
                        runs.append(one(model, prompts, gen, name, kw, cache, batch, instrument=(),
                                        record=args.record))
                        walls.append(one.wall)
                    # the least disturbed runs: the smallest outside-the-model and model times (VM noise)
                    ovh_cpu, mcpu = min(r[0] - r[1] for r in runs), min(r[1] for r in runs)
                    cpu = ovh_cpu + mcpu
                    sec = one(model, prompts, gen, name, kw, cache, batch, instrument=("sections",),
                              record=args.record)[4]
                    steps, syncs, _, decodes, ops = one(model, prompts, gen, name, kw, cache, batch,
                                                        instrument=("syncs",), record=args.record)[2:]
                    ovh = max(0.0, cpu - mcpu) / cpu
                    ok = "ok" if (batch > 1 or ovh * 100 <= budget) else "!!"
                    # the budget: one read per step plus the decode's one-time setup read(s) (as the sync test)
                    sok = "ok" if syncs <= steps + 2 * decodes else "!!"
                    per = {k: 1000 * v / steps for k, v in sec.items()}
                    if batch == 1:
                        rows_b1 += 1
                        if ok != "ok":
                            over.append(f"{label} {cache} {ovh:.1%}")
                        if steps <= 2 * decodes:
                            fixed.append(label)
                    if sok != "ok":
                        sync_over.append(f"{label} {cache} B={batch}")
                    print(f"{label:<13}{cache:<6}{batch:>3}{steps:>7}{cpu:>9.3f}{mcpu:>9.3f}{ovh:>7.1%} {ok}"
                          f"{syncs / steps:>9.2f} {sok}{ops / steps:>7.1f}{per.get('plan', 0):>8.3f}{per.get('sample', 0):>8.3f}"
                          f"{per.get('select', 0):>8.3f}{per.get('apply', 0):>8.3f}{per.get('sinks', 0):>8.3f}{'':>15}"
                          f"{1000 * min(walls) / steps:>9.3f}", end="")
                    if args.replayed and cache == "none":
                        us, same = replayed_loop_us(model, prompts, gen, name, kw, batch, args.repeats)
                        print(f"{us:>12.1f}" + ("" if same else " (replay diverged!)"), end="")
                        if args.evict_mb:
                            us, same = replayed_loop_us(model, prompts, gen, name, kw, batch, args.repeats,
                                                        args.evict_mb)
                            print(f"{us:>15.1f}" + ("" if same else " (replay diverged!)"), end="")
                        if between:
                            us, same = replayed_loop_us(model, prompts, gen, name, kw, batch, args.repeats,
                                                        between=between)
                            print(f"{us:>12.1f}" + ("" if same else " (replay diverged!)"), end="")
                    print(flush=True)
                    if args.ops_detail:
                        steps_p = one(model, prompts, gen, name, kw, cache, batch, instrument=("ops",),
                                      record=args.record)[2]
                        for line in one.profile.table(steps_p, args.ops_detail):
                            print("    " + line)
        if rows_b1:
            print(f"batch 1 within the {budget:.0f}% budget: {rows_b1 - len(over)} of {rows_b1} rows"
                  + (f"; over: {', '.join(over)}" if over else ""))
        if fixed:       # one forward or two a decode: the decode's set-up and first-forward check weigh as much as a step
            print(f"at most 2 steps a decode here (the figure is mostly a decode's fixed cost): {', '.join(sorted(set(fixed)))}")
        print("sync budget: " + ("every row ok" if not sync_over else "over: " + ", ".join(sync_over)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
