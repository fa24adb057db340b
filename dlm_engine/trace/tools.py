"""What ``dlm-trace`` does: integrity check, replay, first divergence, diff, verified re-run, HTML view."""
from __future__ import annotations

import hashlib
import html
import json
import os
from typing import Any, Dict, List, Optional

import numpy as np

from .format import TraceError
from .reader import Sequence, Trace


# --------------------------------------------------------------------------------------------------
# integrity
def verify_integrity(tr: Trace) -> Dict[str, Any]:
    """Everything the reader checks (checksums, the end digest and record counts, every value against the
    header's limits, rows against their batch's step records), that the run completed, and every logits
    record decoded within its error bound. Raises :class:`TraceError` naming the first problem."""
    if tr.problems:
        raise TraceError(f"{tr.name}: {tr.problems[0]}")
    if tr.status != "complete":
        raise TraceError(f"{tr.name}: the recorded run did not complete (status: {tr.status})")
    for key in tr.logit_steps():
        tr.logits(*key)
    return {"sequences": len(tr), "batches": len(tr.batches), "records": len(tr.records), "bytes": tr.size,
            "sha256": hashlib.sha256(tr.data).hexdigest()}


# --------------------------------------------------------------------------------------------------
# comparing trajectories
def _event_steps(s: Sequence) -> np.ndarray:
    parts = [s.step_of[s.step_of >= 0]]
    if s.edits is not None:
        parts += [s.edits["start"], s.edits["end"]]
    return np.unique(np.concatenate(parts)) if parts else np.zeros(0, dtype=np.int64)


class OwnSteps:
    """A sequence seen on its own steps: step ``t`` is the ``t``-th step the row took part in (a row that sat batch
    steps out -- its block done while its neighbours' was not -- or ran in another batch counts only its own), so
    two runs of a row compare by what it did, not by the batch around it."""

    def __init__(self, s: Sequence):
        self.seq, self.gen_length, self.gen_start = s, s.gen_length, s.gen_start
        self.batch_steps = np.asarray(s.steps.step, dtype=np.int64)     # the batch steps the row took part in
        self.tokens = s.tokens
        self.step_of = self.own(s.step_of)
        e = s.edits
        self.edits = None if e is None else dict(e, start=self.own(e["start"]), end=self.own(e["end"]))

    def own(self, t):
        """Batch step(s) ``t`` as the row's own step numbers (0 and -1 kept)."""
        t = np.asarray(t, dtype=np.int64)
        return np.where(t >= 1, np.searchsorted(self.batch_steps, t, side="right"), t)

    def batch_step(self, t: int) -> int:
        """The batch step of the row's own step ``t``."""
        if t <= 0 or not len(self.batch_steps):
            return int(t)
        return int(self.batch_steps[min(t, len(self.batch_steps)) - 1])

    def state_at(self, t: int) -> np.ndarray:
        return self.seq.state_at(self.batch_step(t))


def first_divergence(a: Sequence, b: Sequence) -> Optional[Dict[str, Any]]:
    """The first step whose canvas differs between two sequences, the first such position and both tokens.

    Steps are each row's own (:class:`OwnSteps`); ``batch_step_a``/``batch_step_b`` give the batch steps.
    ``None`` when the trajectories are identical (same tokens committed at the same of their own steps).
    """
    a, b = OwnSteps(a), OwnSteps(b)
    if a.gen_length != b.gen_length:
        return {"step": 0, "position": None, "column": None, "token_a": None, "token_b": None,
                "reason": f"generation lengths differ ({a.gen_length} vs {b.gen_length})"}
    if a.edits is None and b.edits is None:
        so_a, so_b = a.step_of, b.step_of
        differ = (so_a != so_b) | ((a.tokens != b.tokens) & (so_a >= 0))
        if not differ.any():
            return None
        big = np.iinfo(np.int64).max
        sa = np.where(so_a >= 0, so_a, big)
        sb = np.where(so_b >= 0, so_b, big)
        first = np.where(differ, np.minimum(sa, sb), big)
        t = int(first.min())
        p = int(np.flatnonzero(first == t)[0])
    else:
        t = p = None
        for step in np.union1d(_event_steps(a), _event_steps(b)).tolist():
            d = np.flatnonzero(a.state_at(step) != b.state_at(step))
            if d.size:
                t, p = int(step), int(d[0])
                break
        if t is None:
            return None
    kind = None
    if t >= 1 and (a.edits is not None or b.edits is not None):
        before = (a.state_at(t - 1)[p], b.state_at(t - 1)[p])       # a write over a written token: an edit
        mask = a.seq.mask_id
        if mask is not None and any(int(x) != mask and int(x) != int(y.state_at(t)[p])
                                    for x, y in zip(before, (a, b))):
            kind = "an edit over a written token"
    return {"step": t, "position": p, "column": a.gen_start + p, "kind": kind,
            "token_a": int(a.state_at(t)[p]), "token_b": int(b.state_at(t)[p]),
            "step_of_a": int(a.step_of[p]), "step_of_b": int(b.step_of[p]),
            "batch_step_a": a.batch_step(t), "batch_step_b": b.batch_step(t)}


def edit_events(s: Sequence) -> List[Dict[str, Any]]:
    """Every write over a written token of a sequence, and every re-mask, from its edit stream (which keeps each
    earlier holding: column, token, held for ``start <= t < end``): ``step`` (the step that replaced it),
    ``position`` (generation region), ``old`` and ``new`` token (``new`` None for a re-mask), ``confidence`` of the
    new token at that step (None when the trace has no confidences or for a re-mask), ``kind`` edit/remask."""
    e = s.edits
    if e is None or not len(e["col"]):
        return []
    col = np.asarray(e["col"], dtype=np.int64) - s.gen_start
    order = np.lexsort((e["start"], col))
    c, tok, a, b = col[order], np.asarray(e["token"])[order], np.asarray(e["start"])[order], np.asarray(e["end"])[order]
    conf = e.get("confidence")
    conf = None if conf is None else np.asarray(conf, dtype=np.float64)[order]
    n = len(c)
    nxt = np.zeros(n, dtype=bool)
    nxt[:-1] = (c[1:] == c[:-1]) & (a[1:] == b[:-1])          # the next holding of the column starts at the edit
    final = ~nxt & (np.asarray(s.step_of)[c] == b)            # else the final token was written at the edit
    shift = np.r_[np.arange(1, n), n - 1]
    new = np.where(nxt, tok[shift], np.asarray(s.tokens)[c])
    fc = None
    if conf is not None:
        last = s.confidence[c] if s.confidence is not None else np.full(n, np.nan)
        fc = np.where(nxt, conf[shift], last)
    out = []
    for j in range(n):
        written = bool(nxt[j] or final[j])
        cf = None if fc is None or not written or not np.isfinite(fc[j]) else round(float(fc[j]), 4)
        out.append({"step": int(b[j]), "position": int(c[j]), "old": int(tok[j]),
                    "new": int(new[j]) if written else None, "confidence": cf,
                    "kind": "edit" if written else "remask"})
    out.sort(key=lambda d: (d["step"], d["position"]))
    return out


def token_str(tr: Trace, tid: Optional[int], mask_id: Optional[int] = None) -> str:
    if tid is None:
        return "-"
    if mask_id is not None and tid == mask_id:
        return "[MASK]"
    tok = tr.tokenizer
    out = None if tok is None else tok.token(int(tid))
    return str(tid) if out is None else out


def diff(a: Trace, b: Trace) -> Dict[str, Any]:
    """Row-by-row comparison of two traces: the first divergence overall, per-row results, header changes."""
    rows_a = {s.row: s for s in a}
    rows_b = {s.row: s for s in b}
    common = sorted(set(rows_a) & set(rows_b))
    per_row = []
    first = None
    for r in common:
        sa, sb = rows_a[r], rows_b[r]
        d = first_divergence(sa, sb)
        ent = {"row": r, "identical": d is None, "nfe": [sa.nfe, sb.nfe], "steps": [sa.n_steps, sb.n_steps],
               "output_equal": sa.output_ids() == sb.output_ids(),
               "positions_differing": int((sa.tokens != sb.tokens).sum()) if sa.gen_length == sb.gen_length else None}
        if sa.confidence is not None and sb.confidence is not None and d is None:
            both = np.isfinite(sa.confidence) & np.isfinite(sb.confidence)
            ent["max_confidence_diff"] = float(np.abs(sa.confidence[both] - sb.confidence[both]).max()) if both.any() else 0.0
        if d is not None:
            ent["divergence"] = d
            if first is None or d["step"] < first["step"]:
                first = dict(d, row=r)
        per_row.append(ent)
    changed = {}
    for key in ("model", "seed", "device", "dtype"):
        if a.header.get(key) != b.header.get(key):
            changed[key] = [a.header.get(key), b.header.get(key)]
    ca, cb = a.config, b.config
    for grp in sorted(set(ca) | set(cb)):
        if ca.get(grp) != cb.get(grp):
            changed[f"config.{grp}"] = [ca.get(grp), cb.get(grp)]
    return {"rows_a": len(rows_a), "rows_b": len(rows_b), "rows_only_a": sorted(set(rows_a) - set(rows_b)),
            "rows_only_b": sorted(set(rows_b) - set(rows_a)), "rows_compared": len(common),
            "rows_identical": sum(e["identical"] for e in per_row),
            "outputs_equal": sum(e["output_equal"] for e in per_row),
            "first": first, "rows": per_row, "changed": changed, **_totals(a, b)}


def _totals(a: Trace, b: Trace) -> Dict[str, Any]:
    """Aggregates of both traces (:mod:`dlm_engine.metrics`): NFE = sum of per-sequence NFE."""
    ta, tb = a.totals(), b.totals()
    return {"nfe": [ta.nfe, tb.nfe], "nfe_per_sequence": [ta.nfe_per_sequence, tb.nfe_per_sequence],
            "tpf": [ta.tpf, tb.tpf], "model_calls": [ta.model_calls, tb.model_calls]}


def describe_divergence(tr: Trace, d: Dict[str, Any], other: Optional[Trace] = None) -> str:
    if d.get("position") is None:
        return f"row {d['row']}: {d.get('reason', 'differs')}"
    other = other or tr
    mask = (tr.header.get("model") or {}).get("mask_id")
    ta = token_str(tr, d["token_a"], mask)
    tb = token_str(other, d["token_b"], mask)
    kind = f" ({d['kind']})" if d.get("kind") else ""
    return (f"row {d['row']} own step {d['step']} position {d['position']} (column {d['column']}): "
            f"{d['token_a']} {ta!r} vs {d['token_b']} {tb!r}{kind}")


# --------------------------------------------------------------------------------------------------
# HTML view
_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>__TITLE__</title>
<style>
body{font-family:system-ui,sans-serif;margin:1.2em;color:#222}
.seq{margin:0.8em 0 1.4em 0}.meta{font-size:12px;color:#555;margin-bottom:3px}
.cells{display:flex;flex-wrap:wrap;gap:2px}
.c{font-family:ui-monospace,monospace;font-size:13px;padding:2px 3px;border-radius:3px;min-width:0.7em;
   white-space:pre;border:1px solid rgba(0,0,0,.08)}
.m{background:#e8e8e8;color:#aaa}.p{background:#fff;color:#777;border-style:dashed}
.r{background:repeating-linear-gradient(45deg,#f3c9b0,#f3c9b0 3px,#fff 3px,#fff 6px);color:#b0461c}
.rc{outline:2px solid #d22;outline-offset:-2px}
.ed{box-shadow:inset 0 -3px 0 #8a2be2;font-weight:bold}
#bar{position:sticky;top:0;background:#fff;padding:6px 0;border-bottom:1px solid #ddd;z-index:1}
#legend{display:inline-block;width:220px;height:10px;vertical-align:middle;
        background:linear-gradient(90deg,hsl(230,75%,62%),hsl(130,65%,55%),hsl(50,90%,55%),hsl(0,80%,60%))}
</style></head><body>
<h3>__TITLE__</h3>
<div id="bar">step <input id="t" type="range" min="0" max="__TMAX__" value="__TMAX__" style="width:45%">
<b id="tv"></b> &nbsp; <label><input id="pr" type="checkbox"> prompt</label>
&nbsp; commit step: 1 <span id="legend"></span> __TMAX__
&nbsp; <span class="c m">__MASK__</span> masked <span class="c r">__MASK__</span> re-masked <span class="c ed">a</span> edited (hover: the position's history)
<span id="rl" style="display:none">&nbsp; <span class="c rc">&nbsp;</span> recomputed by the step's model call</span></div>
<div id="seqs"></div>
<script>
const D = __DATA__;
const T = D.tmax;
function col(s){ if(s<=0) return '#fff'; const f=T>1?(s-1)/(T-1):0; return 'hsl('+(230-230*f)+',75%,'+(62+8*Math.sin(f*3.14))+'%)'; }
function esc(x){ return x.replace(/[&<>]/g, c=>({'&':'&amp;','<':'&lt;','>':'&gt;'}[c])); }
function escA(x){ return esc(x).replace(/"/g, '&quot;'); }
function render(){
  const t = +document.getElementById('t').value, pr = document.getElementById('pr').checked;
  document.getElementById('tv').textContent = t;
  let h = '';
  for (const s of D.seqs){
    const rr = (s.rec && s.rec[t]) || [];
    const rec = c => rr.some(r => r[0] <= c && c < r[1]);
    const nrec = rr.reduce((n, r) => n + r[1] - r[0], 0);
    h += '<div class="seq"><div class="meta">row '+s.row+' &middot; NFE '+s.nfe+' &middot; steps '+s.steps+
         (s.edits.length ? ' &middot; edits '+s.nedit+(s.pnfe ? ' &middot; post-edit NFE '+s.pnfe : '') : '')+
         (s.rec ? ' &middot; recomputed at this step: '+nrec+' columns' : '')+
         (s.text!==null?' &middot; '+esc(JSON.stringify(s.text)):'')+'</div><div class="cells">';
    if (pr) for (let j=0;j<s.prompt.length;j++) { const p = s.prompt[j];
      h += '<span class="c p'+(rec(s.ps+j)?' rc':'')+'">'+esc(D.vocab[p]??String(p))+'</span>'; }
    for (let i=0;i<s.tok.length;i++){
      let tok=null, st=s.so[i];
      if (st>=0 && st<=t) tok=s.tok[i];
      let again=0; const hist=[];
      for (const e of s.edits) { if (e[0]!==i) continue; hist.push(e);
                                 if (e[2]<=t && t<e[3]) { tok=e[1]; st=e[2]; }
                                 if (e[3]<=t) again=Math.max(again, e[3]); }
      const edited = tok!==null && again>0;       // written over (or re-written after a re-mask) by step t
      hist.sort((a, b) => a[2]-b[2]);
      const name = k => JSON.stringify(D.vocab[k]??String(k));
      const steps = hist.map(e => 'step '+e[2]+' '+name(e[1])+(e[4]!=null?' ('+e[4].toFixed(3)+')':'')+' until '+e[3]);
      if (s.so[i]>0) steps.push('step '+s.so[i]+' '+name(s.tok[i])+(s.conf && s.conf[i]!==null?' ('+s.conf[i].toFixed(3)+')':''));
      const title=escA('position '+i+(s.so[i]>=0?' committed at step '+s.so[i]:' never committed')+
                  (again && tok===null?' (re-masked at step '+again+')':'')+
                  (s.conf && s.conf[i]!==null?' conf '+s.conf[i].toFixed(3):'')+
                  (hist.length?'; history: '+steps.join(' -> '):''));
      const rc = rec(s.gs+i) ? ' rc' : '';
      if (tok===null) h += '<span class="c '+(again?'r':'m')+rc+'" title="'+title+'">'+esc(D.mask)+'</span>';
      else h += '<span class="c'+rc+(edited?' ed':'')+'" style="background:'+col(st)+'" title="'+title+'">'+esc(D.vocab[tok]??String(tok))+'</span>';
    }
    h += '</div></div>';
  }
  document.getElementById('seqs').innerHTML = h;
}
if (D.seqs.some(s => s.rec)) document.getElementById('rl').style.display = '';
document.getElementById('t').oninput = render; document.getElementById('pr').onchange = render; render();
</script></body></html>
"""


def to_html(tr: Trace, max_sequences: int = 50, title: Optional[str] = None) -> str:
    seqs = list(tr)[:max_sequences]
    used = set()
    data = []
    for s in seqs:
        used.update(s.tokens.tolist())
        used.update(s.prompt_ids.tolist())
        ed = []
        if s.edits is not None:
            ec = s.edits.get("confidence")
            for j, (c, tk, a, b) in enumerate(zip(s.edits["col"], s.edits["token"], s.edits["start"], s.edits["end"])):
                cf = None if ec is None or not np.isfinite(ec[j]) else round(float(ec[j]), 4)
                ed.append([int(c) - s.gen_start, int(tk), int(a), int(b), cf])
                used.add(int(tk))
        conf = None
        if s.confidence is not None:
            conf = [None if not np.isfinite(x) else round(float(x), 4) for x in s.confidence]
        data.append({"row": s.row, "nfe": s.nfe, "steps": s.n_steps, "tok": s.tokens.tolist(), "so": s.step_of.tolist(),
                     "prompt": s.prompt_ids.tolist(), "edits": ed, "conf": conf, "text": s.text,
                     "nedit": len(ed), "pnfe": s.metrics.post_edit_nfe,
                     "gs": s.gen_start, "ps": s.gen_start - len(s.prompt_ids), "rec": recomputed_ranges(s)})
    mask = (tr.header.get("model") or {}).get("mask_id")
    vocab = {int(t): _display(token_str(tr, int(t), mask)) for t in used}
    tmax = max([s.n_steps for s in seqs] + [1])
    payload = {"tmax": tmax, "seqs": data, "vocab": vocab, "mask": "\u2592"}
    t = title or f"{os.path.basename(tr.name)} - {(tr.config.get('strategy') or {}).get('name', '')}"
    js = json.dumps(payload).replace("</", "<\\/")
    return (_PAGE.replace("__TITLE__", html.escape(t)).replace("__TMAX__", str(tmax)).replace("__MASK__", "\u2592")
            .replace("__DATA__", js))


def recomputed_ranges(s: Sequence) -> Optional[Dict[int, List[List[int]]]]:
    """``{step: [[a, b), ...]}`` canvas columns the cache recomputed at each step (trace.recomputed=true), else None."""
    tab = s.steps
    rec = tab.scalars.get("recomputed")
    if not isinstance(rec, np.ndarray) or rec.ndim != 2:
        return None
    out = {}
    rec = np.nan_to_num(rec.astype(np.float64), nan=0.0) > 0.5          # steps without a call (set-up): nothing
    for t, row in zip(tab.step.tolist(), rec):
        edges = np.flatnonzero(np.diff(np.concatenate([[0], row.astype(np.int8), [0]])))
        out[int(t)] = edges.reshape(-1, 2).tolist()
    return out


def _display(s: str) -> str:
    # byte-level BPE markers -> visible spaces/newlines
    return s.replace("\u0120", " ").replace("\u010a", "\\n").replace("\u2581", " ")
