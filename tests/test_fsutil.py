"""Atomic writes: whole file or the old one, no temp files left behind, normal permissions."""
import json
import os
import stat

import pytest

from dlm_engine import fsutil


def test_written_files_get_the_umask_permissions_not_private_ones(tmp_path):
    p = tmp_path / "summary.json"
    fsutil.atomic_write_json(str(p), {"a": 1})
    assert json.loads(p.read_text()) == {"a": 1}
    mask = os.umask(0o022)
    os.umask(mask)
    assert stat.S_IMODE(p.stat().st_mode) == 0o666 & ~mask  # e.g. 0644, not mkstemp's 0600


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temp(tmp_path, monkeypatch):
    p = tmp_path / "results.jsonl"
    fsutil.atomic_write_jsonl(str(p), [{"row": 0}])

    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        fsutil.atomic_write_jsonl(str(p), [{"row": 1}])
    assert p.read_text() == '{"row": 0}\n'
    assert sorted(x.name for x in tmp_path.iterdir()) == ["results.jsonl"]
