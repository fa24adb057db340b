"""Registry: the decorator stores the dataclass schema in Hydra's ConfigStore; YAML presets extend it."""
from dataclasses import dataclass

import pytest
from hydra import compose, initialize_config_module
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from dlm_engine.app.config import register_configs
from dlm_engine.core.registry import STRATEGIES, load_plugins, register_strategy, strategy_class


def _compose(overrides):
    load_plugins()
    register_configs()
    with initialize_config_module(config_module="dlm_engine.conf", version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def test_decorator_stores_schema_in_config_store():
    @dataclass
    class DummyConfig:
        name: str = "dummy_for_test"
        knob: float = 0.5

    @register_strategy("dummy_for_test", DummyConfig)
    class Dummy:
        pass

    assert STRATEGIES["dummy_for_test"] is Dummy and Dummy.Config is DummyConfig
    repo = ConfigStore.instance().repo
    assert "dummy_for_test_schema.yaml" in repo["strategy"]
    del STRATEGIES["dummy_for_test"]


def test_yaml_preset_takes_defaults_from_dataclass():
    cfg = _compose([])
    cls = strategy_class(cfg.strategy.name)
    obj = OmegaConf.to_object(cfg.strategy)
    assert isinstance(obj, cls.Config)
    assert obj == cls.Config()  # the YAML adds nothing: one source of defaults


def test_unknown_key_and_wrong_type_fail_in_hydra():
    from omegaconf.errors import ConfigKeyError, ValidationError
    from hydra.errors import ConfigCompositionException

    with pytest.raises((ConfigCompositionException, ConfigKeyError)):
        _compose(["strategy.no_such_key=1"])
    with pytest.raises((ConfigCompositionException, ValidationError)):
        _compose(["strategy.temperature=hot"])


def test_every_registered_strategy_has_a_preset():
    cfgs = {}
    load_plugins()
    for name in STRATEGIES:
        if name.startswith("dummy"):
            continue
        cfg = _compose([f"strategy={name}"])
        cfgs[name] = cfg
        assert cfg.strategy.name == name


def test_cadllm_preset_brings_the_dual_cache_unless_overridden():
    assert _compose(["strategy=cadllm"]).cache.name == "dual"
    assert _compose(["strategy=cadllm", "cache=prefix"]).cache.name == "prefix"
    assert _compose(["strategy=threshold"]).cache.name == "none"
