"""``dlm-trace``: inspect, replay, verify, compare and view trace files.

    dlm-trace show TRACE [--seq I] [--max N] [--tokenizer DIR]
    dlm-trace replay TRACE [--step T] [--json] [--tokenizer DIR]
    dlm-trace verify TRACE [--rerun [--device D] [--model-path DIR]]
    dlm-trace diff A B [--json]
    dlm-trace html TRACE [-o OUT.html] [--max N]

Damaged, truncated or wrong-version files, bad options and unwritable outputs: one line naming the problem
on stderr, exit 2 (``--recover`` reads every intact complete row of a damaged file instead and reports
what was lost). ``verify`` and ``diff`` exit 1 when the check fails or the traces differ.

The read commands import numpy and zstandard only (no torch, no transformers): text comes from the
embedded character tokenizer, or from a tokenizer directory named with ``--tokenizer`` (a path recorded
in a trace header is never followed). ``verify --rerun`` loads torch and the model, and only then.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import List, Optional

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _open(path: str, recover: bool, tokenizer: Optional[str] = None):
    from .reader import open_trace

    tr = open_trace(path, recover=True, tokenizer=tokenizer)
    if tr.problems:
        if not recover:
            from .format import TraceError

            raise TraceError(f"{path}: {tr.problems[0]}" + (" (--recover reads the intact rows)"
                                                             if len(tr) else ""))
        for p in tr.problems:
            print(f"dlm-trace: warning: {path}: {p}", file=sys.stderr)
        print(f"dlm-trace: warning: {path}: recovered {len(tr)} sequences from {len(tr.records)} intact records",
              file=sys.stderr)
    tr.tokenizer  # noqa: B018 - loads the one named by --tokenizer now, so its problems come first
    for n in tr.notes:
        print(f"dlm-trace: note: {n}", file=sys.stderr)
    return tr


def _check_option(name: str, value: Optional[int], lo: int, hi: int, what: str) -> None:
    """``--step 999``: a one-line error naming the option and its valid range."""
    from ..errors import UserError

    if value is not None and not lo <= value <= hi:
        valid = f"{lo}..{hi}" if hi >= lo else "none"
        raise UserError(f"{name} {value} is out of range: {what} (valid: {valid})")


def _short(s: str, n: int = 60) -> str:
    s = s.replace("\n", "\\n")
    return s if len(s) <= n else s[:n - 3] + "..."


def cmd_show(a) -> int:
    import numpy as np

    _check_option("--max", a.max, 0, 1 << 62, "the number of sequences listed")
    _check_option("--max-steps", a.max_steps, 0, 1 << 62, "the number of steps listed")
    tr = _open(a.trace, a.recover, a.tokenizer)
    _check_option("--seq", a.seq, 0, len(tr) - 1, f"the trace has {len(tr)} sequences")
    h = tr.header
    m = h.get("model") or {}
    cfg = tr.config
    git = (h.get("package") or {}).get("git") or {}
    print(f"trace      {tr.name}  ({tr.size} bytes, status {tr.status}, capture {tr.capture})")
    print(f"created    {h.get('created_at')}  dlm_engine {(h.get('package') or {}).get('version')}"
          f"  git {git.get('commit') or '-'}{' (dirty)' if git.get('dirty') else ''}")
    print(f"model      {m.get('name')}  weights {m.get('digest')}  tokenizer {m.get('tokenizer_digest')}")
    print(f"run        device {h.get('device')}  dtype {h.get('dtype')}  seed {h.get('seed')}  "
          f"gen_length {cfg.get('gen_length')}  batch_size {cfg.get('batch_size')}")
    print(f"strategy   {json.dumps(cfg.get('strategy'))}")
    print(f"cache      {json.dumps(cfg.get('cache'))}")
    if h.get("overrides"):
        print(f"overrides  {' '.join(h['overrides'])}")
    v = h.get("versions") or {}
    print("versions   " + "  ".join(f"{k} {v[k]}" for k in sorted(v)))
    print()
    edits = any(s.edits is not None and len(s.edits["col"]) for s in tr)
    print(f"{'row':>4} {'L':>5} {'steps':>5} {'NFE':>5} {'gen':>5} {'TPF':>6} {'conf':>6}"
          + (f" {'edits':>5}" if edits else "") + "  text")
    for s in list(tr)[:a.max]:
        c = s.confidence
        mc = f"{np.nanmean(c):.3f}" if c is not None and np.isfinite(c).any() else "-"
        m = s.metrics
        n_ed = f" {len(s.edits['col']) if s.edits is not None else 0:>5}" if edits else ""   # re-masked / overwritten
        print(f"{s.row:>4} {s.gen_length:>5} {m.finish_step:>5} {m.nfe:>5} {m.generated_tokens:>5} {m.tpf:>6.2f} {mc:>6}"
              f"{n_ed}  {_short(s.text)!r}")
    if len(tr) > a.max:
        print(f"... {len(tr) - a.max} more sequences")
    if not len(tr):
        return 0
    from dlm_engine.metrics import summary_line

    print(summary_line(tr.totals()))
    s = tr[a.seq or 0]
    st = s.steps
    print()
    print(f"steps of row {s.row} (batch {s.batch.index}):")
    names = [k for k in st.scalars if k not in ("committed",)]
    cps = s.commits_per_step()     # every write of the step, those re-masked later included (not the final step_of)
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
    if a.edits:
        from .tools import edit_events, token_str

        ev = edit_events(s)
        mask = (tr.header.get("model") or {}).get("mask_id")
        print()
        print(f"edits of row {s.row}: {sum(e['kind'] == 'edit' for e in ev)} writes over a written token, "
              f"{sum(e['kind'] == 'remask' for e in ev)} re-masks; post-edit NFE {s.metrics.post_edit_nfe}")
        print(f"{'step':>5} {'pos':>5}  old -> new  conf")
        for e in ev[:a.max_steps]:
            new = token_str(tr, e["new"], mask) if e["new"] is not None else "(re-masked)"
            cf = f"{e['confidence']:.3f}" if e["confidence"] is not None else "-"
            print(f"{e['step']:>5} {e['position']:>5}  {token_str(tr, e['old'], mask)!r} -> {new!r}  {cf}")
        if len(ev) > a.max_steps:
            print(f"... {len(ev) - a.max_steps} more")
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
    tr = _open(a.trace, a.recover, a.tokenizer)
    _check_option("--step", a.step, 0, tr.max_step, f"the trace's sequences hold steps 0..{tr.max_step}")
    out = []
    mask = (tr.header.get("model") or {}).get("mask_id")
    for s in tr:
        if a.step is None:
            toks, text = s.tokens, s.text
            out.append({"row": s.row, "tokens": toks.tolist(), "text": text, "step_of": s.step_of.tolist(),
                        "nfe": s.nfe, "steps": s.n_steps, "generated_tokens": s.generated_tokens()})
        else:
            toks = s.state_at(a.step)
            import numpy as np

            again = s.remasked_at(a.step)
            from .tools import edit_events

            # positions holding a token written over an earlier one (an edit at or before the step)
            edited = sorted({e["position"] for e in edit_events(s) if e["kind"] == "edit" and e["step"] <= a.step
                             and toks[e["position"]] != mask})
            out.append({"row": s.row, "step": a.step, "tokens": toks.tolist(),
                        "text": masked_text(tr, toks.tolist(), mask, again),
                        "masked": int((toks == mask).sum()), "remasked": np.flatnonzero(again).tolist(),
                        "edited": edited})
    if a.json:
        print(json.dumps(out))
        return 0
    from .tools import token_str

    for s, o in zip(tr, out):
        if a.step is None:
            print(f"[{o['row']}] {o['text']!r}  (nfe {o['nfe']}, steps {o['steps']})")
        else:
            again = set(o["remasked"])
            cells = "".join(("\u2591" if i in again else "\u2592") if t == mask else _vis(token_str(tr, t))
                            for i, t in enumerate(o["tokens"]))
            note = f", {len(again)} of them re-masked (\u2591)" if again else ""
            if o["edited"]:
                note += f"; {len(o['edited'])} positions edited by then (positions {_short(str(o['edited']), 80)})"
            print(f"[{o['row']}] step {a.step}: {cells}  ({o['masked']} masked{note})")
    return 0


def masked_text(tr, tokens, mask, again) -> str:
    """The decoded text of a canvas state with its masked positions shown where they are: \u2592 for a position
    not decoded yet, \u2591 for one re-masked (``p\u2592nk``, not ``pnk``); each run of decoded tokens is decoded
    on its own."""
    out, run = [], []
    for i, t in enumerate(tokens):
        if t == mask:
            if run:
                out.append(tr.decode_text(run))
                run = []
            out.append("\u2591" if again[i] else "\u2592")
        else:
            run.append(t)
    if run:
        out.append(tr.decode_text(run))
    return "".join(out)


def _vis(s: str) -> str:
    return s.replace("\u0120", " ").replace("\u010a", "\\n").replace("\u2581", " ")


def cmd_verify(a) -> int:
    from .format import TraceError
    from .reader import open_trace
    from .tools import describe_divergence, verify_integrity

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
    from dlm_engine.app.rerun import rerun    # re-decoding is the app's (the entry point may reach any layer)

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

    _check_option("--max", a.max, 0, 1 << 62, "the number of differing rows listed")
    ta, tb = _open(a.a, a.recover, a.tokenizer), _open(a.b, a.recover, a.tokenizer)
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
    print("(each row is compared on its own steps, the steps it took part in: a row that sat batch steps out or "
          "ran in another batch is not a divergence)")
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
            print(f"  row {e['row']}: own step {dv['step']} position {dv['position']}, "
                  f"{e['positions_differing']} final positions differ, NFE {e['nfe'][0]} vs {e['nfe'][1]}")
    return 1


def cmd_html(a) -> int:
    from ..errors import UserError
    from ..fsutil import atomic_write_bytes
    from .tools import to_html

    _check_option("--max", a.max, 0, 1 << 62, "the number of sequences shown")
    out = a.output or (os.path.splitext(a.trace.replace(".partial", ""))[0] + ".html")
    if os.path.isdir(out):
        raise UserError(f"-o {out}: is a directory (give the page's file name, e.g. {os.path.join(out, 'trace.html')})")
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        raise UserError(f"-o {out}: directory '{parent}' does not exist")
    tr = _open(a.trace, a.recover, a.tokenizer)
    atomic_write_bytes(out, to_html(tr, max_sequences=a.max).encode())
    print(out)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dlm-trace", description="Inspect, replay, verify and compare dlm_engine traces.")
    sub = p.add_subparsers(dest="cmd", required=True)

    def add(name, fn, help_, text=True):
        q = sub.add_parser(name, help=help_)
        q.set_defaults(fn=fn)
        q.add_argument("--recover", action="store_true", help="read the intact rows of a damaged/truncated file")
        if text:
            q.add_argument("--tokenizer", metavar="DIR", default=None,
                           help="checkpoint directory whose tokenizer shows text (header paths are not followed)")
        return q

    q = add("show", cmd_show, "header, per-sequence summary and the per-step table of one sequence")
    q.add_argument("trace")
    q.add_argument("--seq", type=int, default=None, help="sequence (results.jsonl order) whose steps are listed")
    q.add_argument("--max", type=int, default=20, help="sequences listed")
    q.add_argument("--max-steps", type=int, default=200, help="steps listed")
    q.add_argument("--edits", action="store_true",
                   help="also list --seq's edits: step, position, old -> new token, confidence (and re-masks)")
    q = add("replay", cmd_replay, "final outputs (or the canvas at --step T) without the model")
    q.add_argument("trace")
    q.add_argument("--step", type=int, default=None)
    q.add_argument("--json", action="store_true", help="JSON list, one object per sequence, results.jsonl order")
    q = add("verify", cmd_verify, "integrity check; --rerun re-runs the decode with the model and compares", text=False)
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

    from ..core.memory import keep_freed_memory

    args = build_parser().parse_args(argv)
    keep_freed_memory()      # (verify --rerun decodes)
    try:
        code = args.fn(args)
    except (TraceError, UserError) as exc:
        print(f"dlm-trace: error: {exc}", file=sys.stderr)
        code = 2
    except BrokenPipeError:
        code = 0
    except OSError as exc:   # an unwritable output, a full disk: the path and the errno text
        print(f"dlm-trace: error: {exc.filename or args.cmd}: {exc.strerror or exc}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        print("dlm-trace: interrupted", file=sys.stderr)
        code = 130
    sys.stdout.flush()
    if argv is None:
        sys.exit(code)
    return code


if __name__ == "__main__":
    main()
