"""``dlm-trace verify --rerun``: re-run a recorded decode (config, prompts, seed and RNG state from the trace)
with the model and compare the new trace with the recorded one."""
from __future__ import annotations

import os
from typing import Any, Dict, Optional

from dlm_engine.app.recording import build_header, config_from_header, restore_rng


def rerun_model_path(model_cfg, given: Optional[str], notes: list) -> Optional[str]:
    """The checkpoint a re-run loads. A path recorded in a trace header is never followed on its own (a trace
    may come from anyone): the user names it with ``--model-path``, unless the recorded model is a seeded
    random model, a preset found in the local Hugging Face cache, or an embedded checkpoint of this
    installation."""
    from dlm_engine.checkpoints import embedded_path
    from dlm_engine.errors import UserError

    if given is not None:
        return str(given)
    recorded = model_cfg.path
    if not recorded:
        return None
    name = str(model_cfg.name)
    local = embedded_path(name) if name.isidentifier() else None   # a plain name, never a path
    if local:
        if str(local) != str(recorded):
            notes.append(f"model: this installation's embedded '{model_cfg.name}' checkpoint ({local}), "
                         f"recorded at {recorded}")
        return str(local)
    raise UserError(f"verify --rerun: the trace was recorded with the checkpoint in '{recorded}'; pass "
                    "--model-path DIR to re-run with it (paths in a trace header are not followed)")


def rerun(tr, device: Optional[str] = None, model_path: Optional[str] = None,
          out_path: Optional[str] = None) -> Dict[str, Any]:
    """Re-run the recorded decode (config, prompts, seed and RNG state from the trace) and compare.

    Returns ``{"reproduced": bool, "first": divergence or None, "notes": [...], "diff": ...}``.
    """
    import torch

    from dlm_engine.app.api import load_model, run_prompts
    from dlm_engine.app.run import validate
    from dlm_engine.core.registry import load_plugins
    from dlm_engine.trace.reader import open_trace
    from dlm_engine.trace.recorder import TraceRecorder
    from dlm_engine.trace.tools import diff, verify_integrity

    verify_integrity(tr)
    load_plugins()
    cfg = config_from_header(tr.header)
    if device is not None:
        cfg.device = device
    notes = []
    cfg.model.path = rerun_model_path(cfg.model, model_path, notes)
    cfg.prompts, cfg.prompts_file = None, None       # the prompts come from the trace
    make_strategy, make_cache = validate(cfg)
    lm = load_model(cfg.model, cfg.device, cfg.dtype)
    rec_model = tr.header.get("model") or {}
    if rec_model.get("digest") != lm.digest:
        notes.append(f"weights digest differs: recorded {rec_model.get('digest')}, now {lm.digest}")
    if rec_model.get("tokenizer_digest") != lm.tokenizer_digest:
        notes.append(f"tokenizer digest differs: recorded {rec_model.get('tokenizer_digest')}, now {lm.tokenizer_digest}")
    if str(lm.device) != tr.header.get("device") or str(lm.dtype).replace("torch.", "") != tr.header.get("dtype"):
        notes.append(f"device/dtype differ: recorded {tr.header.get('device')}/{tr.header.get('dtype')}, "
                     f"now {lm.device}/{str(lm.dtype).replace('torch.', '')}")
    ids = [s.prompt_ids.tolist() for s in tr]
    torch.manual_seed(int(tr.header.get("seed", 0)))
    restore_rng(tr.header.get("rng") or {})
    tmpdir = None
    if out_path is None:
        import tempfile

        tmpdir = tempfile.mkdtemp(prefix="dlm-trace-rerun-")
        out_path = os.path.join(tmpdir, "rerun.dlmt")
    header = build_header(cfg, lm, rows_expected=len(ids), prompt_length=max((len(i) for i in ids), default=1))
    header["rng"] = tr.header.get("rng") or {}
    cap = tr.header.get("capture") or {}
    rec = TraceRecorder(out_path, header, capture=cap.get("level", "tokens"), topk=cap.get("topk") or 5,
                        logit_error_bound=cap.get("logit_error_bound") or 1e-2, recomputed=bool(cap.get("recomputed")))
    error = None
    with rec:
        try:
            run_prompts(lm, ids, make_strategy, make_cache, cfg.gen_length, cfg.batch_size,
                        sinks_for_batch=lambda b, rows: [rec.sink(b, rows)], threads=cfg.threads,
                        fast=bool(cfg.get("fast", True)))
        except RuntimeError as exc:   # e.g. a stalled decode under changed weights: still a divergence
            error = f"{type(exc).__name__}: {exc}"
    new = open_trace(rec.written_path)
    dd = diff(tr, new)
    if error:
        notes.append(f"re-run stopped early ({error})")
    reproduced = dd["first"] is None and not error and dd["rows_compared"] == len(tr)
    out = {"reproduced": reproduced, "first": dd["first"], "notes": notes, "diff": dd, "trace": new,
           "path": rec.written_path}
    return out
