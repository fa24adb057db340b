"""--recover resynchronises after a damaged record: every intact row comes back, exactly the lost rows are
named, and no row is ever wrong (one flipped byte in each record of a multi-batch trace)."""
import os
import re

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402

import trace_corpus as tc  # noqa: E402
from dlm_engine.trace import TraceError, loads  # noqa: E402
from dlm_engine.trace import format as fmt  # noqa: E402
from dlm_engine.trace.reader import scan_frames  # noqa: E402


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return tc.record_base(tmp_path_factory.mktemp("base") / "base.dlmt", capture="confidence")


def _lost_rows(problems):
    """Rows named by the summary line ``lost: N of M rows have no sequence record (rows a..b, c)``."""
    rows = set()
    for p in problems:
        m = re.match(r"lost: \d+ of \d+ rows have no sequence record \(rows (.*)\)$", p)
        if m:
            for part in m.group(1).split(", "):
                lo, _, hi = part.partition("..")
                rows.update(range(int(lo), int(hi or lo) + 1))
    return rows


def _expected_loss(recs, i, ref):
    """Rows a damaged record i takes with it: its own row (sequence) or every row of its batch (batch)."""
    r = recs[i]
    if r.kind == fmt.SEQ:
        return {fmt.get_varint(r.payload, 0)[0]}
    if r.kind == fmt.BATCH:
        return set(tc.batch_v2([(x.kind, bytes(x.payload)) for x in recs], i)[0]["rows"])
    return set()


@pytest.mark.parametrize("where", ["payload", "length", "kind"])
def test_one_flipped_byte_in_each_record_loses_only_that_record(base, where):
    ref = loads(base, recover=False)
    recs, _ = scan_frames(base)
    assert len(ref.batches) == 3 and len(recs) > 15
    H = fmt.REC_HEAD.size
    for i, r in enumerate(recs):
        off = {"payload": r.offset + H + len(r.payload) // 2, "length": r.offset + 1, "kind": r.offset}[where]
        bad = bytearray(base)
        bad[off] ^= 0x5A
        if r.kind == fmt.HEADER:
            with pytest.raises(TraceError, match="header"):
                loads(bytes(bad), recover=True)
            continue
        with pytest.raises(TraceError):                      # strict reading refuses it
            loads(bytes(bad), recover=False)
        tr = loads(bytes(bad), recover=True)
        lost = _expected_loss(recs, i, ref)
        got, wrong = tc.check_recovered(tr, ref)
        assert wrong == 0, (i, where)
        assert {s.row for s in tr} == {s.row for s in ref} - lost, (i, fmt.KIND_NAMES[r.kind], where, tr.problems)
        assert _lost_rows(tr.problems) == lost, (i, tr.problems)
        assert any(f"byte {r.offset}" in p for p in tr.problems), (i, tr.problems)   # the damaged record, by offset
        if r.kind == fmt.STEPS:
            assert any("lost: step records of batch" in p for p in tr.problems), tr.problems
        if r.kind == fmt.BATCH_END:    # its totals and the batch's last step table: the rows stay
            assert any("lost: the batch-end record of batch" in p for p in tr.problems), tr.problems
        if r.kind == fmt.END:
            assert tr.status == "incomplete" and any("end record" in p for p in tr.problems)


def test_damage_spanning_several_records(base):
    """A run of garbage over two sequence records and the batch-end after them: both rows named, the rest back."""
    ref = loads(base, recover=False)
    recs, _ = scan_frames(base)
    seqs = [r for r in recs if r.kind == fmt.SEQ]
    a, b = seqs[3], seqs[4]
    bad = bytearray(base)
    for o in range(a.offset + 3, b.end - 2):
        bad[o] = 0xEE
    tr = loads(bytes(bad), recover=True)
    lost = {fmt.get_varint(a.payload, 0)[0], fmt.get_varint(b.payload, 0)[0]}
    assert {s.row for s in tr} == {s.row for s in ref} - lost
    assert tc.check_recovered(tr, ref)[1] == 0 and _lost_rows(tr.problems) == lost


def test_reordered_and_duplicated_records_keep_every_row(base):
    ref = loads(base, recover=False)
    recs = tc.parse(base)
    seqs = [i for i, (k, _) in enumerate(recs) if k == fmt.SEQ]
    for name, variant in {"reordered": tc._swap(recs, seqs[0], seqs[1]),
                          "duplicated": recs[:seqs[2] + 1] + [recs[seqs[2]]] + recs[seqs[2] + 1:]}.items():
        data = tc.assemble(variant)
        with pytest.raises(TraceError):
            loads(data, recover=False)
        tr = loads(data, recover=True)
        assert len(tr) == len(ref) and tc.check_recovered(tr, ref)[1] == 0, name
        assert tr.problems, name
