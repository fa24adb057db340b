"""LLaDA2.0 presets (``model=llada2_mini`` / ``llada2_flash``: local directory, model_type checked) load the tiny
official-format checkpoint and decode with ``strategy=llada2``; ``experiments/bench_moe.py`` runs (figures only)."""
import pytest
import torch

from conftest import FIXTURES, load_experiment
from dlm_engine.errors import UserError

TINY = FIXTURES / "bdparity" / "tiny_llada2"


def compose(*overrides):
    from hydra import compose as hcompose, initialize_config_module

    from dlm_engine.app.config import register_configs
    from dlm_engine.core.registry import load_plugins

    load_plugins()
    register_configs()
    with initialize_config_module("dlm_engine.conf", version_base="1.3"):
        return hcompose("config", overrides=list(overrides))


@pytest.mark.parametrize("preset", ["llada2_mini", "llada2_flash", "llada2_1_mini"])
def test_preset_loads_the_official_format(preset, tmp_path, monkeypatch):
    from dlm_engine.app.api import load_model
    from dlm_engine.app.run import validate

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    cfg = compose(f"model={preset}")
    assert cfg.model.model_type == "llada2_moe" and cfg.model.hub_id.startswith("inclusionAI/LLaDA2.")
    with pytest.raises(UserError, match="model.path=DIR"):
        validate(cfg)
    cfg = compose(f"model={preset}", f"model.path={TINY}", "strategy=llada2", "strategy.block_length=8",
                  "strategy.steps=8")
    lm = load_model(cfg.model, "cpu", "auto")
    assert type(lm.model).__name__ == "LLaDA2MoeModelLM" and lm.mask_id == 1020 and lm.eos_id == 1017


def test_bench_moe_runs(capsys):
    bench = load_experiment("bench_moe")
    torch.set_num_threads(1)
    model = bench.build()
    bench.bench_dispatch(model, [8], repeat=1)
    out = capsys.readouterr().out
    assert "batched ms" in out and "x " in out
