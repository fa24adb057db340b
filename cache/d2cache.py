"""``cache=d2cache``: d2Cache (docs/specs/d2cache.md §9.3) -- dual adaptive caching by attention rollout and
certainty.

The first call computes every column. Every later call feeds only a *query set* of columns per row through the
model: their keys/values overwrite the stored ones (all other keys/values stay as they were when last queried)
and only they get logits (zeros elsewhere, ``ForwardCall.valid`` False). After every step the next query set of
each row that took part is chosen from what the step showed:

1. the certainty score of each generated position, ``sc = conf · density(decoded, sigma)``, where ``conf`` is
   the confidence cache (the step-1 confidences) and the density is the certainty prior of
   :func:`dlm_engine.core.priors.certainty_density`; positions of the current block get a bonus of ``max(sc)``;
2. the ``current_k`` best-scoring masked positions inside a search window (from the block's first masked
   position to the end of the ``bsize``-aligned chunk holding the ``current_k``-th masked position) -- moved
   one column left for shifted-logit models (Dream), so their logits are computed -- plus the positions this
   step decoded;
3. a nucleus over the attention rollout importance of the call (column sums of the product of the
   head-averaged, identity-mixed, row-normalised attention maps of every layer): the most important other
   columns until their share reaches ``rollout_p`` (at least one);
4. with ``inflate_w > 0``, every gap of at most ``inflate_w`` columns between two selected ones is filled.

Rows of a batch must query the same number of columns: before a call, rows with fewer are topped up with their
highest-importance unselected columns (generated columns first, by certainty). The top-up, the block bonus and
the top-up's offset use maxima over all rows of the call, as the reference does, so in a batch a row's query set
can depend on the other rows (a row alone never sees them).

Reference behaviour kept by default, with the corrected one as an option (docs/specs/d2cache.md §10):

* quirk 2 -- the confidence cache is set at the first step and never refreshed (``update_conf=true``: after every
  step, positions that were masked and whose logits were computed take the step's confidence);
* quirk 3 -- ``bsize``/``bstart`` and the block bonus use the block positions still masked at the step's start
  (``full_block=true``: the whole block, its length and start);
* quirk 14 -- query sets, keys/values, importance and the confidence cache persist across blocks
  (``reset_per_block=true``: a block's first step is a full call and re-takes the confidences).

The confidence a step reports (``FrameDelta.confidence``) is read over the strategy's window; positions outside
it (strategies whose window is one block) count as confidence 0. Defaults: ``rollout_p=0.1, current_k=32,
sigma=10, inflate_w=0`` -- the reference's yaml, which its evaluation uses (its code default for ``inflate_w`` is
4). The rollout needs attention weights, which the model computes with an explicit float32 softmax (eager
attention) whenever this cache is used.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import List

import torch

from dlm_engine.core.capabilities import caps
from dlm_engine.core.kvcache import Cache, RowStore, keep_layer_rows
from dlm_engine.core.priors import CertaintyDensity
from dlm_engine.core.protocol import Columns, recomputed_columns
from dlm_engine.core.registry import register_cache
from dlm_engine.core.selection import first_true
from dlm_engine.core.strategy import masked_after
from dlm_engine.errors import ConfigError

from ._store import key_columns, put_rows, rows_of, scatter_columns, tensor_for


@dataclass
class D2CacheConfig:
    rollout_p: float = 0.1          # nucleus mass over the rollout importance
    current_k: int = 32             # masked positions recomputed per step (by certainty)
    sigma: float = 10.0             # width of the certainty density
    inflate_w: int = 0              # fill gaps of at most this many columns between selected ones (0 = off)
    update_conf: bool = False       # quirk 2: the confidence cache keeps the step-1 values
    full_block: bool = False        # quirk 3: block size/start/bonus from the still-masked block positions
    reset_per_block: bool = False   # quirk 14: state persists across blocks


@register_cache("d2cache", D2CacheConfig)
class D2Cache(Cache):
    offers = caps()                 # logits only for the query set: strategies must cope with missing ones
    needs = caps()                  # a block structure is used when the strategy gives one
    reads_confidence = True         # the confidence cache takes every window position's step confidence

    def __init__(self, config: D2CacheConfig = None):
        super().__init__(config)
        c = self.cfg
        if not 0.0 <= float(c.rollout_p) <= 1.0:
            raise ConfigError(f"cache.rollout_p={c.rollout_p} must be in [0, 1]")
        if isinstance(c.current_k, bool) or not isinstance(c.current_k, int) or c.current_k < 1:
            raise ConfigError(f"cache.current_k={c.current_k} must be an integer >= 1")
        if not float(c.sigma) > 0:
            raise ConfigError(f"cache.sigma={c.sigma} must be > 0")
        if isinstance(c.inflate_w, bool) or not isinstance(c.inflate_w, int) or c.inflate_w < 0:
            raise ConfigError(f"cache.inflate_w={c.inflate_w} must be an integer >= 0")
        self.begin(None)

    def begin(self, canvas) -> None:
        self.store = RowStore()
        self.k, self.v = {}, {}
        self.q = self.imp = self.sc = self.conf = self.has_conf = None
        self._call = None
        self.density = CertaintyDensity(float(self.cfg.sigma))

    def end(self, canvas) -> None:
        self.begin(None)

    def keep_rows(self, index: torch.Tensor) -> None:
        keep_layer_rows(index, self.k, self.v)
        for name in ("q", "imp", "sc", "conf", "has_conf"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.index_select(0, index))

    def _reset(self, call) -> None:
        n, L = self.store.n_held, call.length
        dev = call.input_ids.device
        self.k, self.v = {}, {}
        self.q = torch.zeros((n, L), dtype=torch.bool, device=dev)
        self.imp = torch.zeros((n, L), dtype=torch.float32, device=dev)
        self.sc = torch.zeros((n, L - call.gen_start), dtype=torch.float32, device=dev)
        self.conf = torch.zeros_like(self.sc)
        self.has_conf = torch.zeros(n, dtype=torch.bool, device=dev)

    # -- the query set of a call -------------------------------------------------------------------------------
    def _query_set(self, call) -> torch.Tensor:
        """``[b, Q]`` columns of the call's rows, ascending, the same count per row (topped up)."""
        Q = rows_of(self.store, self.q)
        counts = Q.sum(-1)
        top = int(counts.max())
        need = top - counts
        if bool((need > 0).any()):
            P = call.gen_start
            scores = torch.where(Q, torch.full_like(self.imp[:1], float("-inf")).expand_as(Q), rows_of(self.store, self.imp))
            gen = scores[:, P:] + scores.max() + rows_of(self.store, self.sc)
            scores = torch.cat([scores[:, :P], gen], dim=1)
            best = torch.topk(scores, int(need.max()), dim=-1).indices
            take = torch.arange(best.shape[1], device=best.device)[None, :] < need[:, None]
            Q = Q | torch.zeros_like(Q).scatter_(1, best, take)
        return Q.nonzero()[:, 1].view(Q.shape[0], top)

    # -- hooks -----------------------------------------------------------------------------------------------------
    @contextmanager
    def forward(self, call):
        st = self.store
        fresh = st.follow(call, self.keep_rows)
        if fresh:
            self._reset(call)
        d = call.directive
        full = fresh or (self.cfg.reset_per_block and d is not None and d.block_start)
        if full:
            if not fresh:
                put_rows(st, self.has_conf, torch.zeros_like(rows_of(st, self.has_conf)))
            call.columns = Columns.span(0, call.length)
        else:
            call.columns = Columns.indexed(self._query_set(call))
        call.refreshed = bool(full)
        self._call = dict(full=bool(full), weights=[])
        yield call
        self.imp_call = self._rollout(call, self._call["weights"])
        put_rows(st, self.imp, self.imp_call)
        self._call = None

    @contextmanager
    def attention(self, layer: int, io):
        if self._call is None:
            yield io
            return
        io.need_weights = True
        yield io
        self._call["weights"].append(io.weights.float())

    def keys_values(self, layer: int, io, k: torch.Tensor, v: torch.Tensor):
        if self._call is None:
            return k, v, None
        st = self.store
        T = io.call.length
        H, D = k.shape[1], k.shape[3]
        ks = tensor_for(self.k, layer, st, (H, T, D), k)
        vs = tensor_for(self.v, layer, st, (H, T, D), v)
        if self._call["full"]:
            put_rows(st, ks, k)
            put_rows(st, vs, v)
            return k, v, None
        index = io.call.columns.index
        kk = scatter_columns(st, ks, 2, index, k)
        vv = scatter_columns(st, vs, 2, index, v)
        return kk, vv, key_columns(self._call, T, k.device)

    def _rollout(self, call, weights: List[torch.Tensor]) -> torch.Tensor:
        """Column sums of the attention rollout ``M_L ... M_1`` of this call (``[b, L]``), accumulated from the last
        layer down as a row vector: ``u <- u M_l`` with ``M_l = (E_l + I) / rowsum(E_l + I)``, where ``E_l`` is the
        head-averaged attention map on the queried rows and the identity elsewhere."""
        b, L = call.input_ids.shape
        u = torch.ones((b, L), dtype=torch.float32, device=call.input_ids.device)
        if self._call["full"]:
            for w in reversed(weights):
                m = w.clone()
                m.diagonal(dim1=1, dim2=2).add_(1.0)
                m = m / m.sum(-1, keepdim=True)
                u = torch.bmm(u[:, None, :], m)[:, 0]
            return u
        index = call.columns.index
        is_q = torch.zeros((b, L), dtype=torch.bool, device=u.device).scatter_(1, index, True)
        for w in reversed(weights):
            m = w.scatter_add(2, index[:, :, None], torch.ones_like(w[:, :, :1]))
            m = m / m.sum(-1, keepdim=True)
            u = u.masked_fill(is_q, 0.0) + torch.bmm(u.gather(1, index)[:, None, :], m)[:, 0]
        return u

    # -- choosing the next query set ---------------------------------------------------------------------------------
    def after_step(self, canvas, delta, call) -> None:
        if call is None or delta is None:
            return
        c, st = self.cfg, self.store
        g, G, L = canvas.gen_start, canvas.gen_length, canvas.length
        dev = canvas.device
        rows = call.request.rows
        crow = (torch.arange(st.n_held if st.index is None else int(st.index.numel()), device=dev)
                if rows is None else rows.to(dev)) % canvas.batch_size       # canvas row of every call row
        shift = int(call.logits_shift)
        col = torch.arange(G, device=dev)[None, :]

        masked_pre = canvas.masked()[crow, g:]
        rem = masked_after(canvas, delta.start, delta.commit, delta.remask)[crow]
        written = torch.zeros((canvas.batch_size, G), dtype=torch.bool, device=dev)
        conf_step = torch.zeros((canvas.batch_size, G), dtype=torch.float32, device=dev)
        a, W = delta.start - g, delta.commit.shape[1]
        lo, hi = max(a, 0), min(a + W, G)
        if hi > lo:
            written[:, lo:hi] = delta.commit[:, lo - a:hi - a]
            if delta.confidence is not None:
                cw = delta.confidence[:, lo - a:hi - a].float()
                conf_step[:, lo:hi] = torch.where(torch.isfinite(cw), cw, torch.zeros_like(cw))
        written, conf_step = written[crow], conf_step[crow]

        # the confidence cache: the first step's confidences (quirk 2: never refreshed unless update_conf)
        conf, has = rows_of(st, self.conf), rows_of(st, self.has_conf)
        conf = torch.where(has[:, None], conf, conf_step)
        if c.update_conf:
            computed = recomputed_columns(call)
            valid = computed[:, g - shift:L - shift] if g - shift >= 0 else torch.ones_like(masked_pre)
            conf = torch.where(has[:, None] & valid & masked_pre, conf_step, conf)
        put_rows(st, self.conf, conf)
        put_rows(st, self.has_conf, torch.ones_like(has))

        # the block (quirk 3: the block positions still masked at the step's start)
        d = call.directive
        in_block = torch.zeros((len(crow), G), dtype=torch.bool, device=dev)
        if d is None:
            in_block[:] = True
        else:
            in_block[:, max(d.block[0] - g, 0):max(d.block[1] - g, 0)] = True
        block = in_block if c.full_block else in_block & masked_pre
        block = torch.where(block.any(-1, keepdim=True), block, in_block)
        bsize = block.sum(-1)
        bstart = block.int().argmax(-1)

        # the search window and the certainty-ranked picks
        hit = rem.cumsum(-1) >= c.current_k
        e0 = first_true(hit, G - 1)
        send = (torch.div(e0, bsize, rounding_mode="floor") + 1) * bsize - 1
        window = (col >= bstart[:, None]) & (col <= send[:, None])
        sc = conf * self.density.of_masked(rem)
        sc = sc + block.to(sc.dtype) * sc.max()
        picks = torch.topk(torch.where(window & rem, sc, torch.full_like(sc, float("-inf"))), min(c.current_k, G),
                           dim=-1).indices
        sel = torch.zeros_like(rem).scatter_(1, picks, True) & rem
        resp = torch.cat([sel[:, shift:], torch.zeros_like(sel[:, :shift])], dim=1) if shift else sel.clone()
        q = torch.cat([torch.zeros_like(masked_pre[:, :1]).expand(-1, g), resp | written], dim=1)

        # nucleus over the rollout importance of this call
        imp = self.imp_call
        allowed = ~q
        s = torch.where(allowed, imp, torch.zeros_like(imp))
        pi = s / (s.sum(-1, keepdim=True) + 1e-9)
        vals, order = torch.sort(pi, dim=-1, descending=True)
        keep = vals.cumsum(-1) <= c.rollout_p
        keep[:, 0] = True
        q = q | (torch.zeros_like(q).scatter_(1, order, keep) & allowed)
        if shift and g >= shift:
            q[:, g - shift] = sel[:, 0]
        if c.inflate_w > 0:
            q = _inflate(q, c.inflate_w)
        put_rows(st, self.q, q)
        put_rows(st, self.sc, sc)


def _inflate(q: torch.Tensor, w: int) -> torch.Tensor:
    """Select every column strictly between two consecutive selected columns ``a < b`` with ``b - a <= w``."""
    b, L = q.shape
    pos = torch.arange(L, device=q.device).expand(b, L)
    prev = torch.where(q, pos, torch.full_like(pos, -1)).cummax(-1).values               # last selected <= j
    nxt = torch.where(q, pos, torch.full_like(pos, L)).flip(-1).cummin(-1).values.flip(-1)   # first selected >= j
    return q | ((prev >= 0) & (nxt < L) & (nxt - prev <= w))
