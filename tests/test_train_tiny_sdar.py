"""experiments/train_tiny.py --family sdar: the block-diffusion training masks and an end-to-end run whose output
loads as an SDAR checkpoint."""
import json
import subprocess
import sys

import pytest
import torch

from conftest import ROOT


def test_sdar_block_targets_pick_one_working_block_per_row():
    sys.path.insert(0, str(ROOT / "experiments"))
    from train_tiny import block_targets

    masked = torch.ones(6, 16, dtype=torch.bool)
    work, later = block_targets(masked, width=10, block=4)         # answer columns 10..25: blocks 2..6
    blk = (10 + torch.arange(16)) // 4
    for r in range(6):
        ks = blk[work[r]].unique()
        assert len(ks) == 1                                         # one block, all its answer columns
        k = int(ks[0])
        assert work[r].sum() == (blk == k).sum() and torch.equal(later[r], blk > k)


@pytest.mark.slow
def test_training_script_sdar_family_runs_end_to_end(tmp_path):
    out = tmp_path / "ck"
    proc = subprocess.run([sys.executable, str(ROOT / "experiments" / "train_tiny.py"), "--family", "sdar",
                           "--out", str(out), "--steps", "3", "--d-model", "32", "--layers", "1", "--heads", "2",
                           "--kv-heads", "1", "--mlp", "64", "--batch", "8", "--log-every", "1"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "sdar" and cfg["block_size"] == 4 and cfg["num_key_value_heads"] == 1
    from dlm_engine.app.api import load_directory

    lm = load_directory(str(out))
    assert lm.model.block_size == 4
    log = json.loads((out / "training.json").read_text())["log"]
    assert len(log) == 3 and all(torch.isfinite(torch.tensor(l["loss"])) for l in log)
