"""``dlm-trace``: inspect, replay, verify, compare and view trace files.

    dlm-trace show TRACE [--seq I] [--max N]
    dlm-trace replay TRACE [--step T] [--json]
    dlm-trace verify TRACE [--rerun [--device D] [--model-path DIR]]
    dlm-trace diff A B [--json]
    dlm-trace html TRACE [-o OUT.html] [--max N]

Damaged, truncated or wrong-version files: one line naming the problem on stderr, exit 2
(``--recover`` reads every complete record of a damaged file instead and reports what was lost).
``verify`` and ``diff`` exit 1 when the check fails or the traces differ.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import List, Optional

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _open(path: str, recover: bool):
    from .reader import open_trace

    tr = open_trace(path, recover=True)
    if tr.problems:
        if not recover:
            from .format import TraceError

            raise TraceError(f"{path}: {tr.problems[0]}" + (" (--recover reads the complete records)"
                                                             if len(tr) else ""))
        for p in tr.problems:
            print(f"dlm-trace: warning: {path}: {p}", file=sys.stderr)
        print(f"dlm-trace: warning: {path}: recovered {len(tr)} sequences from {len(tr.records)} intact records",
              file=sys.stderr)
    return tr


def _short(s: str, n: int = 60) -> str:
    s = s.replace("\n", "\\n")
    return s if len(s) <= n else s[:n - 3] + "..."


def cmd_show(a) -> int:
    import numpy as np

    tr = _open(a.trace, a.recover)
    h = tr.header
    m = h.get("model", {})
    cfg = tr.config
    git = h.get("package", {}).get("git", {})
    print(f"trace      {tr.name}  ({tr.size} bytes, status {tr.status}, capture {tr.capture})")
    print(f"created    {h.get('created_at')}  dlm_engine {h.get('package', {}).get('version')}"
          f"  git {git.get('commit') or '-'}{' (dirty)' if git.get('dirty') else ''}")
    print(f"model      {m.get('name')}  weights {m.get('digest')}  tokenizer {m.get('tokenizer_digest')}")
    print(f"run        device {h.get('device')}  dtype {h.get('dtype')}  seed {h.get('seed')}  "
          f"gen_length {cfg.get('gen_length')}  batch_size {cfg.get('batch_size')}")
    print(f"strategy   {json.dumps(cfg.get('strategy'))}")
    print(f"cache      {json.dumps(cfg.get('cache'))}")
    if h.get("overrides"):
        print(f"overrides  {' '.join(h['overrides'])}")
    v = h.get("versions", {})
    print("versions   " + "  ".join(f"{k} {v[k]}" for k in sorted(v)))
    print()
    print(f"{'row':>4} {'L':>5} {'steps':>5} {'NFE':>5} {'gen':>5} {'TPF':>6} {'conf':>6}  text")
    for s in list(tr)[:a.max]:
        c = s.confidence
        mc = f"{np.nanmean(c):.3f}" if c is not None and np.isfinite(c).any() else "-"
        m = s.metrics
        print(f"{s.row:>4} {s.gen_length:>5} {m.finish_step:>5} {m.nfe:>5} {m.generated_tokens:>5} {m.tpf:>6.2f} {mc:>6}"
              f"  {_short(s.text)!r}")
    if len(tr) > a.max:
        print(f"... {len(tr) - a.max} more sequences")
    if not len(tr):
        return 0
    from dlm_engine.metrics import summary_line

    print(summary_line(tr.totals()))
    s = tr[min(a.seq, len(tr) - 1)]
    st = s.steps
    print()
    print(f"steps of row {s.row} (batch {s.batch.index}):")
    names = [k for k in st.scalars if k not in ("committed",)]
    cps = np.bincount(s.step_of[s.step_of >= 1], minlength=int(st.step.max()) + 1 if len(st.step) else 1)
    print(f"{'step':>5} {'NFE':>4} {'wall ms':>8} {'window':>11} {'commit':>6} {'done':>4}  " + "  ".join(names) + "  events")
    for i in range(min(len(st.step), a.max_steps)):
        t = int(st.step[i])
        sc = []
        for k in names:
            v = st.scalars[k]
            x = v[i] if i < len(v) else None
            sc.append(_fmt_scalar(x))
        ev = ",".join(f"{e[1]}:{e[2]}" for e in st.events if e[0] == t)
        print(f"{t:>5} {int(st.nfe[i]):>4} {1000 * float(st.wall_time[i]):>8.2f} "
              f"{f'[{int(st.start[i])},{int(st.start[i]) + int(st.width[i])})':>11} {int(cps[t]) if t < len(cps) else 0:>6} "
              f"{'y' if st.finished[i] else '':>4}  " + "  ".join(sc) + (f"  {ev}" if ev else ""))
    if len(st.step) > a.max_steps:
        print(f"... {len(st.step) - a.max_steps} more steps")
    return 0


def _fmt_scalar(x) -> str:
    import numpy as np

    if x is None:
        return "-"
    if isinstance(x, (float, np.floating)):
        return f"{float(x):.4g}"
    if isinstance(x, np.ndarray):
        return np.array2string(x, precision=3, separator=",")
    return str(x)


def cmd_replay(a) -> int:
    tr = _open(a.trace, a.recover)
    out = []
    mask = tr.header.get("model", {}).get("mask_id")
    for s in tr:
        if a.step is None:
            toks, text = s.tokens, s.text
            out.append({"row": s.row, "tokens": toks.tolist(), "text": text, "step_of": s.step_of.tolist(),
                        "nfe": s.nfe, "steps": s.n_steps, "generated_tokens": s.generated_tokens()})
        else:
            toks = s.state_at(a.step)
            shown = [t for t in toks.tolist() if t != mask]
            out.append({"row": s.row, "step": a.step, "tokens": toks.tolist(), "text": tr.decode_text(shown),
                        "masked": int((toks == mask).sum())})
    if a.json:
        print(json.dumps(out))
        return 0
    from .tools import token_str

    for s, o in zip(tr, out):
        if a.step is None:
            print(f"[{o['row']}] {o['text']!r}  (nfe {o['nfe']}, steps {o['steps']})")
        else:
            cells = "".join(("\u2592" if t == mask else _vis(token_str(tr, t))) for t in o["tokens"])
            print(f"[{o['row']}] step {a.step}: {cells}  ({o['masked']} masked)")
    return 0


def _vis(s: str) -> str:
    return s.replace("\u0120", " ").replace("\u010a", "\\n").replace("\u2581", " ")


def cmd_verify(a) -> int:
    from .format import TraceError
    from .reader import open_trace
    from .tools import describe_divergence, rerun, verify_integrity

    tr = open_trace(a.trace, recover=True)
    try:
        info = verify_integrity(tr)
    except TraceError as exc:
        print(f"dlm-trace: verify: FAILED: {exc}")
        if len(tr):
            print(f"dlm-trace: verify: {len(tr)} complete sequences are readable with --recover")
        return 1
    print(f"intact: {info['sequences']} sequences, {info['batches']} batches, {info['records']} records, "
          f"{info['bytes']} bytes, sha256:{info['sha256']}")
    if not a.rerun:
        return 0
    res = rerun(tr, device=a.device, model_path=a.model_path)
    for n in res["notes"]:
        print(f"note: {n}")
    if res["reproduced"]:
        print(f"reproduced: {len(tr)} sequences, every step and token identical")
        return 0
    d = res["first"]
    if d is not None:
        print("diverged: first at " + describe_divergence(tr, d, res["trace"]) + " (recorded vs re-run)")
    else:
        print("diverged: the re-run did not produce the recorded rows")
    dd = res["diff"]
    print(f"rows identical {dd['rows_identical']}/{dd['rows_compared']}, final outputs equal "
          f"{dd['outputs_equal']}/{dd['rows_compared']}, NFE recorded {dd['nfe'][0]} vs re-run {dd['nfe'][1]}")
    return 1


def cmd_diff(a) -> int:
    from .tools import describe_divergence, diff

    ta, tb = _open(a.a, a.recover), _open(a.b, a.recover)
    d = diff(ta, tb)
    if a.json:
        print(json.dumps(d, default=str))
        return 0 if d["first"] is None and not d["rows_only_a"] and not d["rows_only_b"] else 1
    for k, (x, y) in d["changed"].items():
        print(f"{k}: {json.dumps(x)}  ->  {json.dumps(y)}")
    print(f"rows: {d['rows_a']} vs {d['rows_b']}, compared {d['rows_compared']}, identical trajectories "
          f"{d['rows_identical']}, equal final outputs {d['outputs_equal']}; NFE per sequence "
          f"{d['nfe_per_sequence'][0]:.2f} vs {d['nfe_per_sequence'][1]:.2f}, TPF {d['tpf'][0]:.2f} vs {d['tpf'][1]:.2f} "
          f"(model calls {d['model_calls'][0]} vs {d['model_calls'][1]})")
    if d["first"] is None:
        same = not d["rows_only_a"] and not d["rows_only_b"]
        print("no divergence" + ("" if same else " in the common rows"))
        return 0 if same else 1
    print("first divergence: " + describe_divergence(ta, d["first"], tb))
    shown = 0
    for e in d["rows"]:
        if not e["identical"] and shown < a.max:
            shown += 1
            dv = e["divergence"]
            print(f"  row {e['row']}: step {dv['step']} position {dv['position']}, "
                  f"{e['positions_differing']} final positions differ, NFE {e['nfe'][0]} vs {e['nfe'][1]}")
    return 1


def cmd_html(a) -> int:
    from ..fsutil import atomic_write_bytes
    from .tools import to_html

    tr = _open(a.trace, a.recover)
    out = a.output or (os.path.splitext(a.trace.replace(".partial", ""))[0] + ".html")
    atomic_write_bytes(out, to_html(tr, max_sequences=a.max).encode())
    print(out)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dlm-trace", description="Inspect, replay, verify and compare dlm_engine traces.")
    sub = p.add_subparsers(dest="cmd", required=True)

    def add(name, fn, help_):
        q = sub.add_parser(name, help=help_)
        q.set_defaults(fn=fn)
        q.add_argument("--recover", action="store_true", help="read the complete records of a damaged/truncated file")
        return q

    q = add("show", cmd_show, "header, per-sequence summary and the per-step table of one sequence")
    q.add_argument("trace")
    q.add_argument("--seq", type=int, default=0, help="sequence (results.jsonl order) whose steps are listed")
    q.add_argument("--max", type=int, default=20, help="sequences listed")
    q.add_argument("--max-steps", type=int, default=200, help="steps listed")
    q = add("replay", cmd_replay, "final outputs (or the canvas at --step T) without the model")
    q.add_argument("trace")
    q.add_argument("--step", type=int, default=None)
    q.add_argument("--json", action="store_true", help="JSON list, one object per sequence, results.jsonl order")
    q = add("verify", cmd_verify, "integrity check; --rerun re-runs the decode with the model and compares")
    q.add_argument("trace")
    q.add_argument("--rerun", action="store_true")
    q.add_argument("--device", default=None, help="re-run on this device instead of the recorded one")
    q.add_argument("--model-path", default=None, help="checkpoint directory, if it moved since recording")
    q = add("diff", cmd_diff, "first step/position where two traces differ, and a summary")
    q.add_argument("a")
    q.add_argument("b")
    q.add_argument("--json", action="store_true")
    q.add_argument("--max", type=int, default=10, help="differing rows listed")
    q = add("html", cmd_html, "self-contained HTML page: positions coloured by commit step, step slider")
    q.add_argument("trace")
    q.add_argument("-o", "--output", default=None)
    q.add_argument("--max", type=int, default=50, help="sequences shown")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    from ..errors import UserError
    from .format import TraceError

    args = build_parser().parse_args(argv)
    try:
        code = args.fn(args)
    except (TraceError, UserError) as exc:
        print(f"dlm-trace: error: {exc}", file=sys.stderr)
        code = 2
    except BrokenPipeError:
        code = 0
    except KeyboardInterrupt:
        print("dlm-trace: interrupted", file=sys.stderr)
        code = 130
    sys.stdout.flush()
    if argv is None:
        sys.exit(code)
    return code


if __name__ == "__main__":
    main()
