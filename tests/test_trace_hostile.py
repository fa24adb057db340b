"""Hostile trace files (crafted, checksums and end digest valid): one line, exit 2, no traceback, bounded
memory, never a wrong row under --recover. The corpus generator is tests/trace_corpus.py."""
import json
import os
import subprocess
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import trace_corpus as tc  # noqa: E402
from dlm_engine.trace import TraceError, loads  # noqa: E402
from dlm_engine.trace import format as fmt  # noqa: E402
from dlm_engine.trace.tools import verify_integrity  # noqa: E402

# the reader's documented bound: 64 MB above the interpreter with its imports, for files whose header
# declares a small shape (every file here: 8 rows of 16 positions, vocabulary 128)
MEMORY_BOUND_MB = 64

CHILD = r"""
import contextlib, io, json, os, sys
from dlm_engine.trace.cli import main


def peak_kb():  # this process image's peak RSS (ru_maxrss would carry the parent's peak across exec)
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmHWM:"))


base_rss = peak_kb()
d, base = sys.argv[1], sys.argv[2]
out = {}
for name in sorted(os.listdir(d)):
    p = os.path.join(d, name)
    res = []
    for cmd in (["show", p], ["replay", p, "--json"], ["verify", p], ["html", p, "-o", p + ".html"], ["diff", base, p],
                ["replay", p, "--recover"]):
        o, e = io.StringIO(), io.StringIO()
        try:
            with contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):
                code = main(cmd)
        except BaseException as exc:   # a crash: reported as such
            code, e = "crash", io.StringIO(f"{type(exc).__name__}: {exc}")
        res.append([cmd[0] + (" --recover" if "--recover" in cmd else ""), code, o.getvalue()[-2000:], e.getvalue()])
    out[name] = res
peak = peak_kb()
print(json.dumps({"files": out, "base_kb": base_rss, "peak_kb": peak,
                  "heavy": sorted(m for m in ("torch", "transformers") if m in sys.modules)}))
"""


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return tc.record_base(tmp_path_factory.mktemp("base") / "base.dlmt")


@pytest.fixture(scope="module")
def corpus(base):
    """The crafted files (built from a file of the layout the recorder writes)."""
    files = tc.crafted(base)
    assert len(files) >= 110
    return files


def test_a_1x_file_is_refused_in_one_line(base):
    """Format 1.x (JSON bundles, before 2.0) is no longer read: no shipped file needs it."""
    import struct

    old = base[:len(fmt.MAGIC)] + struct.pack("<HH", 1, 0) + base[len(fmt.MAGIC) + 4:]
    with pytest.raises(TraceError, match=r"unsupported trace format version 1\.0 \(this dlm_engine reads 2\.x\)"):
        loads(old, recover=True)


def test_every_crafted_file_is_refused(corpus):
    for name, data in corpus.items():
        with pytest.raises(TraceError):
            verify_integrity(loads(data, recover=False))


@pytest.mark.slow
def test_crafted_files_give_one_line_no_traceback_and_bounded_memory(corpus, base, tmp_path):
    d = tmp_path / "corpus"
    d.mkdir()
    for i, (name, data) in enumerate(corpus.items()):
        (d / f"{i:03d}.dlmt").write_bytes(data)
    (tmp_path / "base.dlmt").write_bytes(base)
    names = {f"{i:03d}.dlmt": name for i, name in enumerate(corpus)}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(d), str(tmp_path / "base.dlmt")], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rep = json.loads(proc.stdout)
    assert rep["heavy"] == []                         # reading imports neither torch nor transformers
    grown_mb = (rep["peak_kb"] - rep["base_kb"]) / 1024
    assert grown_mb < MEMORY_BOUND_MB, f"reading the corpus grew the process by {grown_mb:.0f} MB"
    for f, results in rep["files"].items():
        for cmd, code, out, err in results:
            where = f"{names[f]}: {cmd}"
            assert code != "crash", f"{where}: {err}"
            assert "Traceback" not in out + err, where
            if cmd == "replay --recover":
                assert code in (0, 2), where
                continue
            if cmd == "verify":
                assert code in (1, 2) and ("FAILED" in out or err.startswith("dlm-trace: error:")), where
                continue
            lines = err.strip().splitlines()
            assert code == 2 and len(lines) == 1 and lines[0].startswith("dlm-trace: error:"), (where, code, err)
            assert names[f] != "" and not os.path.exists(str(d / f) + ".html"), where   # nothing written


def test_recover_never_returns_a_wrong_row(corpus, base):
    ref = loads(base, recover=False)
    for name, data in corpus.items():
        try:
            tr = loads(data, recover=True)
        except TraceError:
            continue                                  # nothing readable (the header itself is bad): fine
        n, wrong = tc.check_recovered(tr, ref)
        assert wrong == 0, name
        assert tr.problems, name                      # and the damage is reported


def test_a_file_of_a_newer_minor_version_is_read_against_its_own_preamble(base):
    import struct

    from dlm_engine.trace import format as fmt

    recs = tc.parse(base)
    newer = struct.pack("<HH", fmt.VERSION[0], fmt.VERSION[1] + 3)
    pre = fmt.MAGIC + newer
    kind, payload = recs[0]
    head = struct.pack("<BI", kind, len(payload))
    header = head + struct.pack("<I", fmt.record_crc(kind, head, payload, pre)) + payload
    data = pre + header + tc.assemble(recs[1:])[len(fmt.PREAMBLE):]
    tr = loads(data, recover=True)
    assert len(tr) == len(loads(base)) and not any("checksum" in p for p in tr.problems), tr.problems
