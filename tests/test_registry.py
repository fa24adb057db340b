"""Registries and presets: one Registry type for strategies, caches and model families; schemas in Hydra's
ConfigStore under schema/ (never offered as options); every YAML preset composes against its dataclass and
restates no default."""
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_module
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from dlm_engine.app.config import register_configs
from dlm_engine.core.registry import CACHES, STRATEGIES, Registry, load_plugins, register_strategy, strategy_class
from dlm_engine.core.strategy import Strategy

CONF = Path(__file__).resolve().parents[1] / "conf"


def _compose(overrides):
    load_plugins()
    register_configs()
    with initialize_config_module(config_module="dlm_engine.conf", version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


@dataclass
class DummyConfig:
    name: str = "dummy_for_test"
    knob: float = 0.5


def test_decorator_stores_schema_under_the_schema_group():
    @register_strategy("dummy_for_test", DummyConfig)
    class Dummy(Strategy):
        pass

    try:
        assert STRATEGIES["dummy_for_test"] is Dummy and Dummy.Config is DummyConfig and Dummy.name == "dummy_for_test"
        repo = ConfigStore.instance().repo
        assert "dummy_for_test.yaml" in repo["schema"]["strategy"]
        assert not any(k.endswith("_schema.yaml") for k in repo.get("strategy", {}))
    finally:
        STRATEGIES.unregister("dummy_for_test")
    assert "dummy_for_test" not in STRATEGIES
    assert "dummy_for_test.yaml" not in ConfigStore.instance().repo["schema"]["strategy"]


def test_duplicate_names_and_wrong_bases_are_errors():
    reg = Registry("widget", Strategy, group=None)

    @reg.register("a")
    class A(Strategy):
        pass

    with pytest.raises(ValueError, match="already registered"):
        @reg.register("a")
        class B(Strategy):
            pass

    with pytest.raises(TypeError, match="must subclass"):
        @reg.register("c")
        class C:
            pass

    reg.register("a")(A)                         # the same class again (a re-import) is harmless
    assert reg.names() == ["a"]
    with pytest.raises(TypeError, match="dataclass"):
        STRATEGIES.register("no_config")(type("NoConfig", (Strategy,), {}))


def test_model_families_share_the_registry_type():
    from dlm_engine.models.families import MODELS
    from dlm_engine.models.loader import architecture

    assert isinstance(MODELS, Registry) and {"llada", "Dream"} <= set(MODELS.names())
    cfg_cls, model_cls = architecture("llada")
    assert model_cls is MODELS.get("llada") and cfg_cls is model_cls.config_class
    from dlm_engine.errors import UserError

    with pytest.raises(UserError, match="unsupported model_type 'gpt2'"):
        architecture("gpt2")


def test_yaml_preset_takes_defaults_from_dataclass():
    cfg = _compose([])
    cls = strategy_class(cfg.strategy.name)
    obj = OmegaConf.to_object(cfg.strategy)
    assert isinstance(obj, cls.Config)
    assert obj == cls.Config()  # the YAML adds nothing: one source of defaults


def test_unknown_key_wrong_type_and_bad_choice_fail_in_hydra():
    from hydra.errors import ConfigCompositionException
    from omegaconf.errors import ConfigKeyError, ValidationError

    with pytest.raises((ConfigCompositionException, ConfigKeyError)):
        _compose(["strategy.no_such_key=1"])
    with pytest.raises((ConfigCompositionException, ValidationError)):
        _compose(["strategy.temperature=hot"])
    with pytest.raises((ConfigCompositionException, ValidationError), match="remasking"):
        _compose(["strategy=threshold", "strategy.remasking=sideways"])   # an Enum field: Hydra checks choices


def _presets():
    return sorted((p.parent.name, p.stem) for group in ("strategy", "cache") for p in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize("group, name", _presets())
def test_every_preset_composes_and_restates_no_default(group, name):
    """A preset extends its schema; a value equal to the dataclass default would be a second source of it."""
    cfg = _compose([f"{group}={name}"])
    node = cfg[group]
    reg = STRATEGIES if group == "strategy" else CACHES
    cls = reg.get(node.name)
    obj = OmegaConf.to_object(node)
    assert isinstance(obj, cls.Config)
    raw = yaml.safe_load((CONF / group / f"{name}.yaml").read_text()) or {}
    defaults = {f.name: f.default for f in dataclasses.fields(cls.Config)}
    for key, value in raw.items():
        if key == "defaults":
            assert f"/schema/{group}/{node.name}@_here_" in value, "preset must extend its schema"
            continue
        assert key in defaults, f"{group}/{name}.yaml: unknown key {key}"
        default = defaults[key]
        default = default.value if hasattr(default, "value") else default
        assert value != default, f"{group}/{name}.yaml restates the default {key}={value!r}"


@pytest.mark.slow      # (composes every strategy: ~3 s; each preset composes in the quick tier above)
def test_every_registered_strategy_and_cache_has_a_preset():
    names = {(g, n) for g, n in _presets()}
    for name in STRATEGIES.names():
        assert ("strategy", name) in names and _compose([f"strategy={name}"]).strategy.name == name
    for name in CACHES.names():
        assert ("cache", name) in names


@pytest.mark.slow
def test_schemas_are_not_options(tmp_path):
    from conftest import run_dlm

    proc = run_dlm(["--help"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    groups = proc.stdout.split("== Configuration groups ==")[1].split("== Config ==")[0]
    assert "strategy: " in groups and "threshold" in groups and "cache: " in groups
    assert "schema" not in groups
    bad = run_dlm(["strategy=no_such_strategy", "trace.record=false"], cwd=tmp_path)
    assert bad.returncode != 0 and "threshold" in bad.stderr, bad.stderr
    offered = bad.stderr.split("search path")[0]             # Hydra lists the options, then its search path
    assert "schema" not in offered, bad.stderr


@pytest.mark.slow       # (an in-process run of a second or more: the quick tier stays under 3 minutes)
def test_cadllm_preset_brings_the_dual_cache_unless_overridden():
    assert _compose(["strategy=cadllm"]).cache.name == "dual"
    assert _compose(["strategy=cadllm", "cache=prefix"]).cache.name == "prefix"
    assert _compose(["strategy=threshold"]).cache.name == "none"
