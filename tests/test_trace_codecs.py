"""The trace's integer codecs choose what they claim to choose: the writer sizes the candidate codings of every
stream without building them (``format._ints_plan`` / ``_col_plan``) and builds only the smallest, and it
quantises a table's wall times in one vectorised pass. These tests build every candidate the slow way and compare."""
import numpy as np
import pytest

from dlm_engine.trace import format as fmt
from dlm_engine.trace import records


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
            out[(fmt.M_RICE, k)] = len(fmt._rice(v, k))
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
        assert fmt._plan_size(fmt._ints_plan(v)) == len(enc)
        assert fmt.encode_ints(None, plan=fmt._ints_plan(v)) == enc


def test_a_column_is_built_from_its_plan_and_round_trips():
    """(Wide columns included: a Rice parameter above ``RICE_KMAX``, which readers refuse, was once written for
    values of 57 to 62 bits.)"""
    for seed in (2, 3):
        for v in _streams(seed, 300):
            for col in (v, -v, v - int(v.mean()) if v.size else v):
                enc = fmt.encode_col(col)
                assert fmt.encode_col(None, plan=fmt._col_plan(col)) == enc
                back, end = fmt.decode_col(enc, 0, col.size)
                assert end == len(enc) and np.array_equal(back, col)


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
