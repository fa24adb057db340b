"""Issue 49 item 4: the dataclass is the one source of defaults and of names. ``conf/config.yaml`` and the
model, task and trace presets set only what differs from their schema (strategy and cache presets:
``tests/test_registry.py``), and the registry gives each strategy/cache config its name (no ``name`` written in
both the decorator and the dataclass)."""
from __future__ import annotations

import dataclasses
from enum import Enum
from pathlib import Path

import pytest
import yaml

from dlm_engine.app.config import ModelConfig, RunConfig, TaskConfig, TraceConfig
from dlm_engine.core.registry import CACHES, STRATEGIES, load_plugins

CONF = Path(__file__).resolve().parents[1] / "conf"
GROUP_SCHEMAS = {"model": ModelConfig, "task": TaskConfig, "trace": TraceConfig}


def _schema(path: Path):
    return RunConfig if path == CONF / "config.yaml" else GROUP_SCHEMAS.get(path.parent.name)


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
        if dataclasses.is_dataclass(value):
            return dataclasses.asdict(value)
    else:
        return dataclasses.MISSING
    return value.name if isinstance(value, Enum) else value


PRESETS = sorted([CONF / "config.yaml"] + [p for g in GROUP_SCHEMAS for p in (CONF / g).glob("*.yaml")])


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: str(p.relative_to(CONF)))
def test_preset_restates_no_default(path):
    schema = _schema(path)
    assert schema is not None, f"{path}: no schema found"
    defaults = {f.name: _default(f) for f in dataclasses.fields(schema)}
    data = yaml.safe_load(path.read_text()) or {}
    restated = [k for k, v in data.items() if k != "defaults" and k in defaults and defaults[k] == v
                and not (isinstance(v, bool) != isinstance(defaults[k], bool))]
    assert not restated, f"{path.relative_to(CONF)} restates the dataclass defaults of {restated}"


def test_registry_names_every_config():
    """Every registered strategy/cache config gets its ``name`` from the registry: written once, in the
    decorator; ``Config().name`` is the registered name and it is the config's first own field."""
    load_plugins()
    for registry in (STRATEGIES, CACHES):
        for name, cls in registry.items():
            assert getattr(cls.Config, "__registry_named__", None) == name, (
                f"{registry.kind} '{name}': {cls.Config.__name__} declares its own `name` field; the registry "
                f"gives it (drop the field)")
            assert cls.Config().name == name and cls.name == name
