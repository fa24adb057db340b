"""The sequence record (``docs/trace_format.md``, *Sequence record*): one row's final tokens, the step that
committed each position (in the smallest of several codings, among them the commit order), and the
confidences, earlier holdings (edits) and top-k candidates the capture level adds."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .codecs import (_Sizer, _f16_bits, _f32_bits, _plan_size, decode_col, decode_f16, decode_f32, decode_ints,
                     delta0, encode_col, encode_ints, planes, unplanes, unzigzag, zigzag)
from .framing import TraceError, ZSTD_LEVEL, check_int, get_varint, in_range, put_varint, zc, zd

__all__ = [
    "F_CONF", "F_EDITS", "F_TOPK", "SeqData", "encode_seq", "encode_seqs", "ORDER_CHUNK", "SeqLimits", "decode_seq",
]

# --------------------------------------------------------------------------------------------------
# the per-sequence record
F_CONF, F_EDITS, F_TOPK = 1, 2, 4


@dataclass
class SeqData:
    """One row's final state; ``tokens``/``step_of`` cover the generation region only."""

    row: int
    tokens: np.ndarray                      # [L] int64
    step_of: np.ndarray                     # [L] int64: -1 masked, 0 given, t >= 1 committed at step t
    nfe: int = 0
    finish_step: int = -1                   # step after which the row was finished (-1: never marked)
    confidence: Optional[np.ndarray] = None  # [L] float32 (float16 precision); NaN where never committed
    # earlier holdings of positions that were later remasked or overwritten: column (absolute canvas
    # column), token, first step held, first step no longer held, confidence
    edits: Optional[Dict[str, np.ndarray]] = None
    topk_ids: Optional[np.ndarray] = None     # [n_committed, k] int64 (committed positions, in column order)
    topk_logits: Optional[np.ndarray] = None  # [n_committed, k] float32


def encode_seq(s: SeqData, level: int = ZSTD_LEVEL) -> bytes:
    return encode_seqs([s], level)[0]


def encode_seqs(seqs: Sequence[SeqData], level: int = ZSTD_LEVEL) -> List[bytes]:
    """The sequence record of each of ``seqs`` (what :func:`encode_seq` gives for each), with every candidate
    coding of all of them sized in one :class:`_Sizer` pass: a batch's records take about the numpy calls of
    one (the writer encodes a batch's records together at its end)."""
    sizer = _Sizer()
    preps = [_seq_prep(s, sizer) for s in seqs]
    sizer.run()
    return [_seq_build(p, sizer, level) for p in preps]


def _seq_prep(s: SeqData, sizer: "_Sizer") -> Dict[str, Any]:
    """What a sequence record's encoding needs, its candidate streams registered with ``sizer``."""
    L = int(s.tokens.shape[0])
    flags = (F_CONF if s.confidence is not None else 0) | (F_EDITS if s.edits is not None and len(s.edits["col"]) else 0) \
        | (F_TOPK if s.topk_ids is not None else 0)
    tok = s.tokens.astype(np.int64)
    if L and int(tok.min()) < 0:
        raise ValueError("negative token id")
    zs = zigzag(delta0(s.step_of))
    p = {"s": s, "L": L, "flags": flags, "tok": tok, "zs": zs, "tokens": _tokens_prep(tok, sizer),
         "steps": _steps_prep(s.step_of, zs, sizer)}
    if flags & F_CONF:
        p["conf"] = sizer.ints(_f16_bits(np.asarray(s.confidence)[s.step_of >= 1]))
    if flags & F_EDITS:
        e = s.edits
        p["edits"] = [sizer.ints(np.asarray(e[k], dtype=np.int64)) for k in ("col", "token", "start", "end")]
        if flags & F_CONF:
            p["edits"].append(sizer.ints(_f16_bits(np.asarray(e["confidence"], dtype=np.float32))))
    if flags & F_TOPK:
        ids = np.asarray(s.topk_ids, dtype=np.int64)
        p["topk"] = (ids.shape, sizer.ints(ids.ravel()),
                     sizer.ints(_f32_bits(np.asarray(s.topk_logits, dtype=np.float32).ravel())))
    return p


def _seq_build(p: Dict[str, Any], sizer: "_Sizer", level: int) -> bytes:
    s, L, tok, zs = p["s"], p["L"], p["tok"], p["zs"]
    out = bytearray()
    for v in (s.row, L, s.nfe, s.finish_step + 1, p["flags"]):
        put_varint(out, v)
    # layout 4: the smallest token coding and the smallest step coding, chosen independently
    cands = [b"\x04" + _tokens_build(p["tokens"], sizer, level) + _steps_build(p["steps"], sizer, level)]
    if L:   # layout 1: one zstd frame of token + step byte planes
        tb, sb = sizer.plan(p["tokens"]["plain"])[4], sizer.plan(p["steps"]["deltas"])[4]   # (bytes of their maxima)
        joint = zc(planes(tok, tb) + planes(zs, sb), level)
        head = bytearray((1, tb, sb))
        put_varint(head, len(joint))
        cands.append(bytes(head) + joint)
    out += min(cands, key=len)
    if "conf" in p:
        out += encode_ints(None, level, sizer.plan(p["conf"]))
    if "edits" in p:
        put_varint(out, len(s.edits["col"]))
        for h in p["edits"]:
            out += encode_ints(None, level, sizer.plan(h))
    if "topk" in p:
        (n, k), ids, logits = p["topk"]
        put_varint(out, n)
        put_varint(out, k)
        out += encode_ints(None, level, sizer.plan(ids)) + encode_ints(None, level, sizer.plan(logits))
    return bytes(out)


def _tokens_prep(tok: np.ndarray, sizer: "_Sizer") -> Dict[str, Any]:
    """Token codings (``method:u8`` then): 0 ints(ids); 1 / 2 a sorted dictionary of the distinct ids
    (``varint U``, ints of its gaps) and each position's index into it as ints (1) or as a column (2: runs, e.g.
    an EOS tail). All are sized; :func:`_tokens_build` builds the smallest."""
    if not tok.size:
        return {"plain": sizer.ints(tok)}
    uniq, idx = np.unique(tok, return_inverse=True)
    idx = idx.ravel()
    return {"plain": sizer.ints(tok), "n_uniq": len(uniq), "gaps": sizer.ints(delta0(uniq)),
            "ints_idx": sizer.ints(idx), "col_idx": sizer.col(idx)}


def _tokens_build(t: Dict[str, Any], sizer: "_Sizer", level: int) -> bytes:
    plain = sizer.plan(t["plain"])
    if "gaps" not in t:
        return b"\x00" + encode_ints(None, level, plain)
    gaps, ints_idx, col_idx = sizer.plan(t["gaps"]), sizer.plan(t["ints_idx"]), sizer.col_plan(t["col_idx"])
    head = _plan_size(gaps) + 3
    m = min((_plan_size(plain), 0), (head + _plan_size(ints_idx), 1), (head + col_idx[0], 2))[1]
    if m == 0:
        return b"\x00" + encode_ints(None, level, plain)
    out = bytearray((m,))
    put_varint(out, t["n_uniq"])
    out += encode_ints(None, level, gaps)
    return bytes(out) + (encode_ints(None, level, ints_idx) if m == 1 else encode_col(None, level, col_idx))


def _decode_tokens(buf, pos: int, L: int) -> Tuple[np.ndarray, int]:
    if pos >= len(buf):
        raise TraceError("sequence record is cut short")
    m = buf[pos]
    pos += 1
    if m == 0:
        return decode_ints(buf, pos, L)
    if m not in (1, 2):
        raise TraceError(f"sequence record has unknown token coding {m}")
    return _decode_dict(buf, pos, L, as_col=m == 2)


def _decode_dict(buf, pos: int, L: int, as_col: bool) -> Tuple[np.ndarray, int]:
    """Token ids as a sorted dictionary (``varint U``, ints of its gaps) and an index per position."""
    nu, pos = get_varint(buf, pos)
    if nu > L or (L and nu == 0):
        raise TraceError("sequence record has a bad dictionary size")
    gaps, pos = decode_ints(buf, pos, nu)
    idx, pos = decode_col(buf, pos, L, "token index") if as_col else decode_ints(buf, pos, L)
    if L and not 0 <= int(idx.min()) <= int(idx.max()) < nu:
        raise TraceError("sequence record has a dictionary index out of range")
    if nu and int(gaps.min()) < 0:
        raise TraceError("sequence record has a bad token dictionary")
    return np.cumsum(gaps)[idx], pos


ORDER_CHUNK = 64          # values per mixed-radix integer


class _Remaining:
    """The positions still to commit, as a Fenwick tree over their indices: rank and select in O(log m)."""

    def __init__(self, m: int):
        self.m = m
        self.tree = [0] + [i & -i for i in range(1, m + 1)]      # every index present
        self.top = 1 << max(m.bit_length() - 1, 0)

    def rank(self, i: int) -> int:
        """How many remaining indices are below ``i``."""
        t, r = self.tree, 0
        while i > 0:
            r += t[i]
            i -= i & -i
        return r

    def select(self, r: int) -> int:
        """The remaining index of rank ``r`` (0-based)."""
        t, pos, step = self.tree, 0, self.top
        while step:
            if pos + step <= self.m and t[pos + step] <= r:
                pos += step
                r -= t[pos]
            step >>= 1
        return pos

    def remove(self, i: int) -> None:
        t, i = self.tree, i + 1
        while i <= self.m:
            t[i] -= 1
            i += i & -i


def _steps_prep(step_of: np.ndarray, zs: np.ndarray, sizer: "_Sizer") -> Dict[str, Any]:
    """Step codings (``method:u8`` then): 0 ints(zigzag deltas); 1 a column; 2 / 3 the commit order
    (:func:`_order_prep`). All are sized; :func:`_steps_build` builds the smallest."""
    return {"deltas": sizer.ints(zs), "col": sizer.col(step_of), "order": _order_prep(step_of, sizer)}


def _steps_build(t: Dict[str, Any], sizer: "_Sizer", level: int) -> bytes:
    deltas, col, order = sizer.plan(t["deltas"]), sizer.col_plan(t["col"]), t["order"]
    cands = [(_plan_size(deltas), 0), (col[0], 1)]
    if order is not None:
        head, vals, radix = _order_head(order, sizer, level), order["vals"], order["radix"]
        bits = float(np.log2(np.asarray(radix, dtype=np.float64)).sum()) if radix else 0.0
        ranks = sizer.plan(order["ranks"])
        cands += [(len(head) + int(bits / 8) + 2 * (len(vals) // ORDER_CHUNK + 1), 2),
                  (len(head) + _plan_size(ranks), 3)]
    m = min(cands)[1]
    if m == 0:
        return b"\x00" + encode_ints(None, level, deltas)
    if m == 1:
        return b"\x01" + encode_col(None, level, col)
    if m == 2:
        return b"\x02" + head + _pack_radix(vals, radix)
    return b"\x03" + head + encode_ints(None, level, ranks)


def _pack_radix(vals: List[int], radix: List[int]) -> bytes:
    out = bytearray()
    for c in range(0, len(vals), ORDER_CHUNK):
        acc, mult = 0, 1
        for v, b in zip(vals[c:c + ORDER_CHUNK], radix[c:c + ORDER_CHUNK]):
            acc += v * mult
            mult *= b
        put_varint(out, (acc.bit_length() + 7) // 8)
        out += acc.to_bytes((acc.bit_length() + 7) // 8, "little")
    return bytes(out)


def _commit_order(so: np.ndarray, level: int) -> Optional[Tuple[bytes, List[int], List[int]]]:
    """The commit order of :func:`_order_prep` on its own: its header, the rank gaps and their radixes."""
    sizer = _Sizer()
    order = _order_prep(so, sizer)
    if order is None:
        return None
    sizer.run()
    return _order_head(order, sizer, level), order["vals"], order["radix"]


def _order_prep(so: np.ndarray, sizer: "_Sizer") -> Optional[Dict[str, Any]]:
    """The commit steps as the order positions were committed in: a class per position (0 committed at a
    step, 1 given, 2 still masked); the steps that commit anything (``varint S``, a column of their gaps
    ``s[i] - s[i-1] - 1`` from ``s[-1] = 0``, a column of their commit counts - 1); and for each such step
    the rank of each position it commits among the positions still to commit (ascending within the step, so
    each rank is coded as the gap to the previous one, with the radix that leaves room for the rest). Method 2
    packs these gaps as mixed-radix integers of ``ORDER_CHUNK`` values, each ``varint nbytes`` + its
    little-endian bytes: close to log2 of the number of possible orders (a permutation of 128 positions takes
    ~90 bytes, zigzag deltas ~130). Method 3 writes them as ints: smaller when the ranks are small (a block
    at a time, left to right). None where a step below -1 leaves it undefined."""
    if so.size and int(so.min()) < -1:
        return None
    committed = np.flatnonzero(so >= 1)
    cs = so[committed]
    busy, cnt = np.unique(cs, return_counts=True)      # (cnt: int64 counts of the busy steps)
    out = {"cls": sizer.col(np.where(so >= 1, 0, np.where(so == 0, 1, 2))), "S": busy.size,
           "gaps": sizer.col(np.diff(busy, prepend=0) - 1), "cnt": sizer.col(cnt - 1), "vals": [], "radix": []}
    m = committed.size
    if m:
        left = m - np.concatenate(([0], np.cumsum(cnt)[:-1]))          # positions still to commit at each step
        if m <= 1024:   # rank among those still to commit = earlier positions committed at the same step or later
            later = np.tril(cs[None, :] >= cs[:, None], -1)
            order = np.lexsort((np.arange(m), cs))                    # by step, then by position
            r = later.sum(1)[order]
        else:
            order = np.lexsort((np.arange(m), cs))
            rem, r = _Remaining(m), np.empty(m, dtype=np.int64)
            at = 0
            for k in cnt.tolist():
                idx = order[at:at + k].tolist()
                r[at:at + k] = [rem.rank(i) for i in idx]
                for i in idx:
                    rem.remove(i)
                at += k
        first = np.repeat(np.concatenate(([0], np.cumsum(cnt)[:-1])), cnt)   # where each commit's step starts
        j = np.arange(m) - first
        prev = np.where(j == 0, -1, np.concatenate(([-1], r[:-1])))
        out["vals"] = (r - prev - 1).tolist()
        out["radix"] = (np.repeat(left - cnt, cnt) + j - prev).tolist()
    out["ranks"] = sizer.ints(np.asarray(out["vals"], dtype=np.int64))
    return out


def _order_head(order: Dict[str, Any], sizer: "_Sizer", level: int) -> bytes:
    out = bytearray(encode_col(None, level, sizer.col_plan(order["cls"])))
    put_varint(out, order["S"])
    return bytes(out) + encode_col(None, level, sizer.col_plan(order["gaps"])) \
        + encode_col(None, level, sizer.col_plan(order["cnt"]))


def _decode_steps(buf, pos: int, L: int, max_step: int) -> Tuple[np.ndarray, int]:
    if pos >= len(buf):
        raise TraceError("sequence record is cut short")
    m = buf[pos]
    pos += 1
    if m == 0:
        zs, pos = decode_ints(buf, pos, L)
        return np.cumsum(unzigzag(zs)), pos
    if m == 1:
        return decode_col(buf, pos, L, "commit steps")
    if m not in (2, 3):
        raise TraceError(f"sequence record has unknown step coding {m}")
    cls, pos = decode_col(buf, pos, L, "position classes")
    if L and not 0 <= int(cls.min()) <= int(cls.max()) <= 2:
        raise TraceError("sequence record has a bad position class")
    committed = np.flatnonzero(cls == 0)
    S, pos = get_varint(buf, pos)
    if S > committed.size or (committed.size and not S):
        raise TraceError(f"sequence record has {S} commit steps for {committed.size} commits")
    gaps, pos = decode_col(buf, pos, S, "commit steps")
    cnt, pos = decode_col(buf, pos, S, "commits per step")
    if S and (int(gaps.min()) < 0 or int(gaps.max()) > max_step or int(cnt.min()) < 0 or int(cnt.max()) >= L):
        raise TraceError("sequence record has a bad commit step or count")
    busy = np.cumsum(gaps + 1)
    cnt = cnt + 1
    if int(cnt.sum()) != committed.size:
        raise TraceError("sequence record commit counts do not match its positions")
    ranks = None
    if m == 3:
        ranks, pos = decode_ints(buf, pos, committed.size)
    m = committed.size
    if ranks is not None:          # method 3: every rank at once (the gaps add up within each step)
        v = ranks
        first = np.repeat(np.cumsum(cnt) - cnt, cnt)
        j = np.arange(m) - first
        c = np.cumsum(v + 1)
        r = c - np.where(first > 0, c[np.maximum(first - 1, 0)], 0) - 1
        prev = np.where(j == 0, -1, np.concatenate(([-1], r[:-1])))
        if m and (int(v.min()) < 0 or bool((v >= np.repeat(m - np.cumsum(cnt), cnt) + j - prev).any())):
            raise TraceError("sequence record has a bad commit order")
        rank = r.tolist()
    else:                          # method 2: mixed-radix digits, each radix known once the previous digit is
        rank, left, acc, nleft, i = [0] * m, m, 0, 0, 0
        for k in cnt.tolist():
            prev = -1
            for j in range(k):
                if not nleft:
                    if acc:
                        raise TraceError("sequence record has a bad commit order")
                    nb, pos = get_varint(buf, pos)
                    if nb > 8 * ORDER_CHUNK or pos + nb > len(buf):
                        raise TraceError("sequence record commit order runs past the record")
                    acc, pos, nleft = int.from_bytes(bytes(buf[pos:pos + nb]), "little"), pos + nb, ORDER_CHUNK
                acc, v = divmod(acc, left - k + j - prev)
                nleft -= 1
                prev += v + 1
                rank[i] = prev
                i += 1
            left -= k
        if acc:
            raise TraceError("sequence record has a bad commit order")
    step_of = np.where(cls == 1, 0, -1).astype(np.int64)
    step_of[committed[_order_positions(rank, cnt.tolist())]] = np.repeat(busy, cnt)
    return step_of, pos


def _order_positions(rank: List[int], cnt: List[int]) -> np.ndarray:
    """Which of the committed positions (by index, ascending) each commit took, from its rank among those still
    to commit when its step began. Built from the last step back: a step's commits join the positions of the
    later steps at their ranks (list inserts; a Fenwick tree's select above 8192 commits)."""
    m = len(rank)
    out = np.empty(m, dtype=np.int64)
    if m > 8192:
        rem, at = _Remaining(m), 0
        for k in cnt:
            picked = [rem.select(r) for r in rank[at:at + k]]
            out[at:at + k] = picked
            for x in picked:
                rem.remove(x)
            at += k
        return out
    order: List[int] = []                  # commit numbers in position order, for the steps seen so far
    end = m
    for k in reversed(cnt):
        for c in range(end - k, end):
            order.insert(rank[c], c)
        end -= k
    out[np.asarray(order, dtype=np.int64)] = np.arange(m)
    return out


@dataclass
class SeqLimits:
    """What a sequence record may hold, from the header and its batch record (see ``reader.Limits``)."""

    length: Optional[int] = None       # the exact number of positions (None: up to ``max_length``)
    max_length: int = 1 << 20
    vocab: int = 1 << 31               # token ids < vocab
    max_step: int = 1 << 30            # step_of, finish_step and edit steps <= max_step
    topk: Optional[int] = None         # the exact k of top-k tables (None: 1..1024)
    col_lo: int = 0                    # edit columns lie in [col_lo, col_hi) (the generation region)
    col_hi: int = 1 << 40


def decode_seq(buf: bytes, lim: Optional[SeqLimits] = None) -> SeqData:
    """Decode and range-check one sequence record; every size is checked against ``lim`` before use."""
    lim = lim or SeqLimits()
    row, pos = get_varint(buf, 0)
    L, pos = get_varint(buf, pos)
    nfe, pos = get_varint(buf, pos)
    fin, pos = get_varint(buf, pos)
    flags, pos = get_varint(buf, pos)
    if lim.length is not None and L != lim.length:
        raise TraceError(f"sequence record of row {row} has {L} positions, its batch has {lim.length}")
    if L > lim.max_length:
        raise TraceError(f"sequence record claims {L} positions")
    if flags & ~(F_CONF | F_EDITS | F_TOPK):
        raise TraceError(f"sequence record has unknown flags {flags}")
    check_int(nfe, "sequence NFE", 0, 1 << 40)
    if pos >= len(buf):
        raise TraceError("sequence record is cut short")
    layout = buf[pos]
    pos += 1
    if layout == 1:
        if pos + 2 > len(buf):
            raise TraceError("sequence record is cut short")
        tb, sb = buf[pos], buf[pos + 1]
        if not (1 <= tb <= 8 and 1 <= sb <= 8):
            raise TraceError("sequence record has a bad byte width")
        ln, pos = get_varint(buf, pos + 2)
        if pos + ln > len(buf):
            raise TraceError("sequence stream runs past the record")
        raw = zd(buf[pos:pos + ln], limit=L * (tb + sb), expect=L * (tb + sb))
        pos += ln
        tok = unplanes(raw, L, tb)
        zs = unplanes(raw, L, sb, offset=L * tb)
    elif layout == 4:
        tok, pos = _decode_tokens(buf, pos, L)
        step_of, pos = _decode_steps(buf, pos, L, lim.max_step)
        zs = None
    else:
        raise TraceError(f"unknown sequence layout {layout}")
    if zs is not None:
        step_of = np.cumsum(unzigzag(zs))
    in_range(tok, 0, lim.vocab - 1, f"token id of row {row}")
    in_range(step_of, -1, lim.max_step, f"commit step of row {row}")
    check_int(fin - 1, f"finish step of row {row}", -1, lim.max_step)
    s = SeqData(row=row, tokens=tok, step_of=step_of, nfe=nfe, finish_step=fin - 1)
    if flags & F_CONF:
        committed = step_of >= 1
        c, pos = decode_f16(buf, pos, int(committed.sum()))
        conf = np.full(L, np.nan, dtype=np.float32)
        conf[committed] = c
        s.confidence = conf
    if flags & F_EDITS:
        n, pos = get_varint(buf, pos)
        if n > max(L, 1) * (min(lim.max_step, 1 << 20) + 1):
            raise TraceError(f"sequence record of row {row} claims {n} edits")
        e = {}
        for key in ("col", "token", "start", "end"):
            e[key], pos = decode_ints(buf, pos, n)
        if flags & F_CONF:
            e["confidence"], pos = decode_f16(buf, pos, n)
        in_range(e["col"], lim.col_lo, lim.col_hi - 1, f"edit column of row {row}")
        in_range(e["token"], 0, lim.vocab - 1, f"edit token id of row {row}")
        in_range(e["start"], 0, lim.max_step, f"edit step of row {row}")
        in_range(e["end"], 0, lim.max_step, f"edit step of row {row}")
        if n and bool((e["end"] < e["start"]).any()):
            raise TraceError(f"sequence record of row {row} has an edit that ends before it starts")
        s.edits = e
    if flags & F_TOPK:
        n, pos = get_varint(buf, pos)
        k, pos = get_varint(buf, pos)
        if n != int((step_of >= 1).sum()):
            raise TraceError(f"sequence record of row {row} has {n} top-k rows for {int((step_of >= 1).sum())} commits")
        if (lim.topk is not None and k != lim.topk) or not 1 <= k <= 1024:
            raise TraceError(f"sequence record of row {row} has top-k tables of k={k}")
        ids, pos = decode_ints(buf, pos, n * k)
        lg, pos = decode_f32(buf, pos, n * k)
        in_range(ids, 0, lim.vocab - 1, f"top-k token id of row {row}")
        s.topk_ids, s.topk_logits = ids.reshape(n, k), lg.reshape(n, k)
    if pos != len(buf):
        raise TraceError("sequence record has trailing bytes")
    return s
