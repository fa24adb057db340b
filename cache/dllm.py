"""``cache=dllm``: dLLM-Cache (docs/specs/d2cache.md §9.2) -- adaptive feature caching.

Every canvas column keeps a residual stream in every call (so every column gets valid logits), but in each layer
only a chosen set of positions goes through the Q/K/V projections, attention and the FFN; every other position
takes its cached attention output and cached FFN output (both after their output projections), added to its
*current* residual stream.

Schedule (per row, ``n`` = steps the row took part in so far): the prompt ``[0, P)`` is recomputed when
``n % kp == 0``, the response ``[P, L)`` when ``n % kr == 0``. Between response refreshes the ``rou`` fraction
of response positions whose fresh value vectors differ most from the cached ones (lowest cosine similarity) is
recomputed (``int(R * rou)`` positions per layer); the value vectors of *all* response positions are written in
those layers. Keys and values of the recomputed positions overwrite the stored ones; attention always runs over
the stored keys/values of the whole canvas.

Reference behaviour kept by default (each has an option for the corrected one, docs/specs/d2cache.md §10):

* quirk 13 -- layer 0 is always recomputed in full (``layer0_full=false``: it follows the schedule); the flags of
  a step come from the rows active at the previous step, which must agree, else the decode stops with
  :class:`ScheduleDiverged` (``per_row_schedule=true``: every row follows its own count; rows that select fewer
  positions are padded, so the result of a row does not depend on the others);
* quirk 14 -- the cache persists across blocks (``reset_per_block=true``: a block's first step refreshes
  everything and restarts the counts; needs a strategy that names its blocks).

Defaults: ``kp=50, kr=4, rou=0.25`` -- what the reference's evaluation runs with when no per-task value exists
(its yaml leaves ``kp``/``kr`` null and ``gen_args`` falls back to 50/4; ``rou`` 0.25 in code and yaml). The
reference's code default for ``kr`` is 2.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dlm_engine.core.capabilities import Cap, caps
from dlm_engine.core.kvcache import Cache, RowStore, keep_layer_rows
from dlm_engine.core.protocol import Columns
from dlm_engine.core.registry import register_cache
from dlm_engine.errors import ConfigError, UserError

from ._store import key_columns, padded_index, rows_of, scatter_columns, tensor_for


class ScheduleDiverged(UserError):
    """The rows of a batch reached different refresh flags under the shared (reference) schedule."""


@dataclass
class DLLMCacheConfig:
    kp: int = 50                    # recompute the prompt every kp steps
    kr: int = 4                     # recompute the whole response every kr steps
    rou: float = 0.25               # fraction of response positions recomputed adaptively in between (0 = none)
    layer0_full: bool = True        # quirk 13: layer 0 is always recomputed in full
    per_row_schedule: bool = False  # quirk 13: one schedule for the batch (rows must agree); True: per row
    reset_per_block: bool = False   # quirk 14: the cache persists across blocks; True: refresh at block starts


@register_cache("dllm", DLLMCacheConfig)
class DLLMCache(Cache):
    offers = caps(Cap.BLOCK_LOGITS, Cap.SUFFIX_LOGITS, Cap.WINDOW_LOGITS)

    def __init__(self, config: DLLMCacheConfig = None):
        super().__init__(config)
        c = self.cfg
        for key in ("kp", "kr"):
            v = getattr(c, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"cache.{key}={v} must be an integer >= 1")
        if not 0.0 <= float(c.rou) <= 1.0:
            raise ConfigError(f"cache.rou={c.rou} must be in [0, 1]")
        self.needs = caps(Cap.BLOCKS) if c.reset_per_block else caps()
        self.begin(None)

    def begin(self, canvas) -> None:
        self.store = RowStore()
        self.k, self.v, self.att, self.mlp = {}, {}, {}, {}
        self.steps = torch.zeros(0, dtype=torch.long)      # per held row: calls it took part in (host)
        self.prev = torch.zeros(0, dtype=torch.bool)       # per held row: took part in the previous call (host)
        self._call = None

    def end(self, canvas) -> None:
        self.begin(None)

    def keep_rows(self, index: torch.Tensor) -> None:
        keep_layer_rows(index, self.k, self.v, self.att, self.mlp)
        host = index.cpu()
        self.steps, self.prev = self.steps[host], self.prev[host]

    # -- schedule -------------------------------------------------------------------------------------------
    def _flags(self, call):
        """``(rp, rr)`` of this call: Python bools (one schedule) or ``[b]`` bool tensors (per-row schedules)."""
        c = self.cfg
        rows = self._rows_host
        n = self.steps if rows is None else self.steps[rows]
        if c.per_row_schedule:
            rp, rr = (n % c.kp == 0), (n % c.kr == 0)
            if bool((rp == rp[0]).all()) and bool((rr == rr[0]).all()):
                return bool(rp[0]), bool(rr[0])
            return rp.to(call.input_ids.device), rr.to(call.input_ids.device)
        ref = self.steps[self.prev] if bool(self.prev.any()) else n     # (rows of the previous step all finished)
        fp, fr = (ref % c.kp == 0), (ref % c.kr == 0)
        if not (bool((fp == fp[0]).all()) and bool((fr == fr[0]).all())):
            raise ScheduleDiverged(
                "cache=dllm: the rows' refresh schedules diverged (rows took part in different numbers of steps); "
                "the reference stops here with an assertion -- set cache.per_row_schedule=true")
        return bool(fp[0]), bool(fr[0])

    # -- hooks ----------------------------------------------------------------------------------------------
    @contextmanager
    def forward(self, call):
        st = self.store
        if st.follow(call, self.keep_rows):
            self.k, self.v, self.att, self.mlp = {}, {}, {}, {}
            self.steps = torch.zeros(st.n_held, dtype=torch.long)
            self.prev = torch.ones(st.n_held, dtype=torch.bool)
        self._rows_host = None if st.index is None else st.index.cpu()
        d = call.directive
        if self.cfg.reset_per_block and d is not None and d.block_start:
            if self._rows_host is None:
                self.steps.zero_()
            else:
                self.steps[self._rows_host] = 0
        # every column runs through the layers (the selection indexes the whole canvas): a model that would leave
        # out the columns after the window's block (LLaDA2's block-causal forward) computes them all here
        if call.request.aux is None:
            call.columns = Columns.span(0, call.length)
        rp, rr = self._flags(call)
        full = rp is True and rr is True
        call.refreshed = full
        self._call = dict(rp=rp, rr=rr, P=int(call.gen_start), layer=None)
        self._last = None
        yield call
        prev = torch.zeros(st.n_held, dtype=torch.bool)
        prev[slice(None) if self._rows_host is None else self._rows_host] = True
        self.prev = prev
        self.steps += prev.long()          # a row's step count: the calls it took part in
        if self._last is not None and self._last[0] is not None:     # (None: the last layer recomputed all)
            index, keep = self._last
            rec = torch.zeros(call.input_ids.shape, dtype=torch.bool, device=index.device)
            call.recomputed = rec.scatter_(1, index, True) if keep is None else rec.scatter_(1, index, keep)
        self._call = None

    def _selection(self, layer: int, io):
        """The layer's query rows: ``(index, keep, v_new, adaptive_rows)``; index None = every column."""
        cc = self._call
        if layer == 0 and self.cfg.layer0_full:
            return None, None, None, None
        rp, rr, P = cc["rp"], cc["rr"], cc["P"]
        x = io.x
        b, T = x.shape[0], x.shape[1]
        R = T - P
        k = int(R * float(self.cfg.rou))
        if isinstance(rp, bool):
            if rp and rr:
                return None, None, None, None
            parts = [torch.arange(P, device=x.device).expand(b, P)] if rp else []
            v_new = adaptive = None
            if rr:
                parts.append(torch.arange(P, T, device=x.device).expand(b, R))
            elif float(self.cfg.rou) > 0 and layer in self.v:     # (k may be 0: the values are still written)
                v_new, chosen = self._adaptive(layer, io, P, k)
                parts.append(chosen)
                adaptive = True
            if not parts:
                return torch.zeros((b, 0), dtype=torch.long, device=x.device), None, None, None
            return torch.cat(parts, dim=1), None, v_new, adaptive
        # per-row schedules: a selection mask per row, padded to the largest count
        sel = torch.zeros((b, T), dtype=torch.bool, device=x.device)
        sel[:, :P] = rp[:, None]
        sel[:, P:] = rr[:, None]
        v_new = adaptive = None
        if float(self.cfg.rou) > 0 and layer in self.v and not bool(rr.all()):
            v_new, chosen = self._adaptive(layer, io, P, k)
            adaptive = ~rr
            pick = torch.zeros_like(sel).scatter_(1, chosen, True)
            sel |= pick & adaptive[:, None]
        index, keep = padded_index(sel)
        return index, keep, v_new, adaptive

    def _adaptive(self, layer: int, io, P: int, k: int):
        """Fresh response value vectors and the ``k`` response columns whose values moved most (per row)."""
        v_new = io.project_v(io.x[:, P:])                                 # [b, Hkv, R, D]
        cached = rows_of(self.store, self.v[layer])[:, :, P:]
        b, H, R, D = v_new.shape
        sim = F.cosine_similarity(v_new.transpose(1, 2).reshape(b, R, H * D),
                                  cached.transpose(1, 2).reshape(b, R, H * D), dim=-1)
        chosen = torch.topk(sim, k, dim=-1, largest=False).indices + P
        return v_new, chosen

    @contextmanager
    def attention(self, layer: int, io):
        if self._call is None:
            yield io
            return
        index, keep, v_new, adaptive = self._selection(layer, io)
        self._call["layer"] = (layer, index, keep, v_new, adaptive)
        io.query_cols = index
        yield io
        out = io.out_proj(io.out)
        if layer == 0 and self.cfg.layer0_full:
            io.out, io.projected = out, True          # never read back: layer 0 is always recomputed
            return
        T, dm = io.x.shape[1], out.shape[-1]
        att = tensor_for(self.att, layer, self.store, (T, dm), out)
        io.out, io.projected = scatter_columns(self.store, att, 1, index, out, keep), True

    def keys_values(self, layer: int, io, k: torch.Tensor, v: torch.Tensor):
        if self._call is None or (layer == 0 and self.cfg.layer0_full):
            return k, v, None
        _, index, keep, v_new, adaptive = self._call["layer"]
        st = self.store
        T = io.x.shape[1]
        H, D = k.shape[1], k.shape[3]
        ks = tensor_for(self.k, layer, st, (H, T, D), k)
        vs = tensor_for(self.v, layer, st, (H, T, D), v)
        kk = scatter_columns(st, ks, 2, index, k, keep)
        vv = scatter_columns(st, vs, 2, index, v, keep)
        if v_new is not None:        # the value vectors of every response position (adaptive rows)
            P = self._call["P"]
            cols = torch.arange(P, T, device=v.device).expand(v.shape[0], T - P)
            rows_keep = None
            if adaptive is not True:
                rows_keep = adaptive[:, None].expand_as(cols)
            vv = scatter_columns(st, vs, 2, cols, v_new, rows_keep)
        self._last = (index, keep)
        if index is None:
            return k, v, None
        return kk, vv, key_columns(self._call, T, k.device)

    @contextmanager
    def ffn(self, layer: int, io):
        if self._call is None or (layer == 0 and self.cfg.layer0_full):
            yield io
            return
        _, index, keep, _, _ = self._call["layer"]
        io.cols = index
        yield io
        T = io.x.shape[1]
        mlp = tensor_for(self.mlp, layer, self.store, (T, io.out.shape[-1]), io.out)
        io.out = scatter_columns(self.store, mlp, 1, index, io.out, keep)
