"""The trace's integer codecs choose what they claim to choose: the writer sizes the candidate codings of every
stream without building them (``format._ints_plan`` / ``_col_plan``) and builds only the smallest, and it
quantises a table's wall times in one vectorised pass. These tests build every candidate the slow way and compare."""
import numpy as np
import pytest

from dlm_engine.trace import format as fmt
from dlm_engine.trace import codecs, records


def _streams(seed: int, count: int):
    rng = np.random.default_rng(seed)
    for t in range(count):
        n = int(rng.integers(0, 400))
        kind = t % 8
        if kind == 0:
            v = rng.integers(0, 2, n)
        elif kind == 1:
            v = rng.integers(0, 1 << int(rng.integers(1, 62)), n)
        elif kind == 2:
            v = rng.geometric(float(rng.uniform(0.01, 0.9)), n) - 1          # what Rice codes are for
        elif kind == 3:
            v = np.abs(np.cumsum(rng.integers(-3, 4, n)))
        elif kind == 4:
            v = np.full(n, int(rng.integers(0, 1000)))
        elif kind == 5:
            v = np.where(rng.random(n) < 0.05, rng.integers(0, 1 << 40, n), rng.integers(0, 4, n))   # escapes
        elif kind == 6:
            v = np.sort(rng.integers(0, 50_000, n))
        else:
            v = rng.integers(0, 16, n) << int(rng.integers(0, 20))
        yield np.asarray(v, dtype=np.int64)


def _built_sizes(v: np.ndarray):
    """Every coding encode_ints may pick, built: {(method, param): data bytes}."""
    vmax = int(v.max()) if v.size else 0
    nb, width = fmt.nbytes_for(vmax), vmax.bit_length()
    out = {(fmt.M_PLANES, nb): len(fmt.planes(v, nb)), (fmt.M_BITS, width): len(fmt.bitpack(v, width))}
    if v.size >= 8 and width <= fmt.RICE_KMAX:
        k0 = max(int(np.log2(max(float(v.mean()), 1.0))), 0)
        for k in range(max(0, k0 - 1), min(k0 + 1, width) + 1):
            out[(fmt.M_RICE, k)] = len(codecs._rice(v, k))
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_an_integer_stream_is_coded_the_smallest_way_it_sizes(seed):
    for v in _streams(seed, 400):
        enc = fmt.encode_ints(v)
        m, param = enc[0], enc[1]
        back, end = fmt.decode_ints(enc, 0, v.size)
        assert end == len(enc) and np.array_equal(back, v)
        built = _built_sizes(v)
        smallest = min(built.values())
        if m == fmt.M_ZPLANES:                 # zstd only replaces a coding it beats
            assert len(enc) - 2 < smallest + 2
            continue
        assert built[(m, param)] == smallest, (v[:20], m, param, built)
        # the first smallest in (size, method, param) order wins, and the size it planned is the size it built
        assert (m, param) == min((s, mm, p) for (mm, p), s in built.items())[1:]
        assert codecs._plan_size(codecs._ints_plan(v)) == len(enc)
        assert fmt.encode_ints(None, plan=codecs._ints_plan(v)) == enc


def test_a_column_is_built_from_its_plan_and_round_trips():
    """(Wide columns included: a Rice parameter above ``RICE_KMAX``, which readers refuse, was once written for
    values of 57 to 62 bits.)"""
    for seed in (2, 3):
        for v in _streams(seed, 300):
            for col in (v, -v, v - int(v.mean()) if v.size else v):
                enc = fmt.encode_col(col)
                assert fmt.encode_col(None, plan=codecs._col_plan(col)) == enc
                back, end = fmt.decode_col(enc, 0, col.size)
                assert end == len(enc) and np.array_equal(back, col)


def _same_plan(a, b) -> bool:
    return a[:3] == b[:3] and a[4] == b[4] and np.array_equal(np.asarray(a[3]), np.asarray(b[3]))


@pytest.mark.parametrize("seed", [4, 5])
def test_streams_sized_together_get_the_plans_they_get_one_by_one(seed):
    """``_plans`` sizes a record's (or a batch's) streams in one pass; each plan must be the one ``_ints_plan``
    makes alone -- including means just below and at powers of two (where the float ``log2`` of the one-by-one
    sizing could round across an integer), empty and short streams, uint64 values past 2^63 and the long wide
    streams left to the one-by-one path."""
    rng = np.random.default_rng(seed)
    streams = list(_streams(seed, 160))
    for m in (1, 2, 5, 20, 40, 55):
        for n in (8, 9, 1000, 70_000):
            for d in (-1, 0, 1):
                v = np.full(n, 1 << m, dtype=np.int64)
                v[0] += d
                streams.append(v)
    streams += [np.zeros(0, dtype=np.int64), np.arange(7), np.array([1 << 63, 5], dtype=np.uint64),
                np.arange(20, dtype=np.int64).astype(np.uint64)]
    rng.shuffle(streams)
    at = 0
    while at < len(streams):
        group = streams[at:at + int(rng.integers(1, 12))]
        at += len(group)
        for v, got in zip(group, codecs._plans(group)):
            assert _same_plan(got, codecs._ints_plan(v)), (v[:8], v.size, got[:3], codecs._ints_plan(v)[:3])


def test_columns_sized_together_are_built_as_one_by_one():
    sizer, cols = codecs._Sizer(), []
    for v in _streams(6, 200):
        for col in (v, -v, v - int(v.mean()) if v.size else v):
            cols.append((col, sizer.col(col)))
    sizer.run()
    for col, h in cols:
        plan = sizer.col_plan(h)
        assert plan[:2] == codecs._col_plan(col)[:2]
        assert fmt.encode_col(None, plan=plan) == fmt.encode_col(col)


def test_a_batch_of_sequence_records_is_each_record_alone():
    """The writer encodes a batch's sequence records together (``encode_seqs``): the bytes are those of each
    record encoded alone, and they decode back."""
    rng = np.random.default_rng(7)
    seqs = []
    for r, L in enumerate((0, 1, 5, 48, 48, 128, 300)):
        tok = rng.integers(0, 4096, L)
        tok[L // 2:] = 2
        so = np.where(rng.random(L) < 0.2, 0, rng.permutation(L) // 3 + 1)
        s = fmt.SeqData(row=r, tokens=tok, step_of=so.astype(np.int64), nfe=L, finish_step=L // 3,
                        confidence=rng.random(L).astype(np.float32))
        if L > 4:
            s.edits = {"col": np.arange(3), "token": np.array([5, 6, 7]), "start": np.array([1, 2, 3]),
                       "end": np.array([4, 5, 6]), "confidence": np.array([0.5, 0.25, 0.125], dtype=np.float32)}
            c = int((so >= 1).sum())
            s.topk_ids, s.topk_logits = rng.integers(0, 4096, (c, 2)), rng.normal(size=(c, 2)).astype(np.float32)
        seqs.append(s)
    together = fmt.encode_seqs(seqs)
    for s, enc in zip(seqs, together):
        assert enc == fmt.encode_seqs([s])[0] == fmt.encode_seq(s)
        back = fmt.decode_seq(enc)
        assert np.array_equal(back.tokens, s.tokens) and np.array_equal(back.step_of, s.step_of)


def _wall_codes_one_by_one(wall_us, prev, mb):
    out = []
    for t in wall_us:
        out.append(records.wall_code(max(int(t) - prev, 0), mb))
        prev = max(int(t), prev)
    return out


def test_wall_times_are_quantised_step_by_step_in_one_pass():
    rng = np.random.default_rng(4)
    for trial in range(2000):
        n = int(rng.integers(0, 60))
        scale = int(10 ** rng.uniform(0, 15))
        steps = rng.integers(-scale // 10, scale + 2, n)       # clocks may step back: durations clamp at 0
        wall = np.cumsum(np.abs(steps)) if trial % 2 else np.cumsum(steps)
        prev = int(rng.integers(0, scale + 2))
        mb = int(rng.integers(1, 6)) if trial % 4 == 0 else records.WALL_MANTISSA
        assert records.quantise_wall(wall, prev, mb).tolist() == _wall_codes_one_by_one(wall.tolist(), prev, mb)
    # every duration up to 5,000 us, both sides of every power of two, the code cap and the scalar fallback
    ds = list(range(5000)) + [(1 << k) + j for k in range(5, 63) for j in (-2, -1, 0, 1, 2) if (1 << k) + j < 1 << 63]
    for mb in range(1, 6):
        got = records.quantise_wall(np.array(ds, dtype=np.int64), 0, mb).tolist()
        assert got == _wall_codes_one_by_one(ds, 0, mb)
        single = [int(records.quantise_wall(np.array([d]), 0, mb)[0]) for d in ds]
        assert single == [records.wall_code(d, mb) for d in ds]
    d = np.arange(5000)
    back = records.wall_values(records.quantise_wall(np.cumsum(d), 0), records.WALL_MANTISSA)
    assert (np.abs(back - d) * 16 <= d).all()        # within 1/16 of the measured duration



# Run in a child process: a zstd context used by two threads at once can crash the interpreter (it did, with one
# module-wide compressor), which should fail this test, not end the whole test session.
_THREADS_CHECK = r"""
import sys, threading
import numpy as np, zstandard
from dlm_engine.trace import format as fmt

def payloads(seed, count=150, size=20_000):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 16, size, dtype=np.uint8).tobytes() for _ in range(count)]

def run(fn, n=4):
    errors = []
    def guarded(i):
        try:
            fn(i)
        except BaseException as exc:
            errors.append(repr(exc))
    ts = [threading.Thread(target=guarded, args=(i,)) for i in range(n)]
    for t in ts: t.start()
    for t in ts: t.join()
    return errors

data = {i: payloads(i) for i in range(4)}
if sys.argv[1] == "compress":        # every frame written on 4 threads at once decompresses (checksum) to its bytes
    frames = {i: [] for i in data}
    errors = run(lambda i: frames[i].extend(fmt.zc(p, fmt.ZSTD_LEVEL) for p in data[i]))
    check = zstandard.ZstdDecompressor()
    bad = sum(check.decompress(f) != p for i in data for f, p in zip(frames[i], data[i]))
else:                                # frames read on 4 threads at once (format.zd) give their own bytes
    frames = {i: [fmt.zc(p) for p in data[i]] for i in data}
    got = {i: [] for i in data}
    errors = run(lambda i: got[i].extend(fmt.zd(f, limit=len(p), expect=len(p)) for f, p in zip(frames[i], data[i])))
    bad = sum(g != p for i in data for g, p in zip(got[i], data[i]))
print("errors", len(errors), errors[:2], "bad", bad)
"""


@pytest.mark.slow
@pytest.mark.parametrize("side", ["compress", "decompress"])
def test_zstd_frames_stay_whole_when_threads_use_them_at_once(side):
    """Each recorder's writer is a thread, and a recorder compresses its header on the thread that opens it, so
    ``format.zc`` runs on several threads at once (readers may too). zstd releases the GIL while it works: one
    context shared by two threads wrote corrupt frames (~3% of these) or crashed the process. Contexts are pooled,
    one caller at a time."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _THREADS_CHECK, side], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    assert out.stdout.strip() == "errors 0 [] bad 0", out.stdout
