"""Structured (dataclass) schemas of the top-level run config and the model group.

Strategy and cache schemas are stored by their registration decorators; these are stored by
:func:`register_configs`. YAML files in ``conf/`` extend the schemas, so unknown keys and wrong
types are rejected by Hydra itself.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import MISSING


@dataclass
class ModelConfig:
    name: str = MISSING
    path: Optional[str] = None               # local official-format checkpoint directory
    random: Optional[Dict[str, Any]] = None  # config of a seeded random model (used when path is null)
    random_seed: int = 0
    chat_template: str = "auto"              # auto | on | off (auto: on for instruct models whose tokenizer has one)
    instruct: bool = False                   # chat-tuned checkpoint (presets set it)
    model_type: Optional[str] = None         # expected config.json model_type (presets; checked before loading)
    hub_id: Optional[str] = None             # the official repository this preset expects a local copy of (hints only)
    eot_token_id: Optional[int] = None       # end-of-turn id; null = config.json's, else the tokenizer's EoT token
    max_length: Optional[int] = None         # positions a canvas may use; null = config.json's max_sequence_length
                                             # (or max_position_embeddings). Larger runs a RoPE model past the
                                             # length it was trained on: extrapolation, quality not guaranteed


@dataclass
class TraceConfig:
    record: bool = True
    capture: str = "tokens"                  # tokens | confidence | topk | logits
    recomputed: bool = False                 # per step: the canvas columns the cache recomputed (scalar `recomputed`)
    topk: int = 5
    logit_error_bound: float = 1e-2
    queue_size: int = 256
    filename: str = "trace.dlmt"


@dataclass
class TaskConfig:
    name: str = "prompts"
    n: int = 50                              # number of held-out examples (checkable tasks)
    tasks: Optional[List[str]] = None        # subset of tasks; null = all
    seed: Optional[int] = None               # held-out seed; null = the fixed default


@dataclass
class RunConfig:
    model: Any = MISSING
    strategy: Any = MISSING
    cache: Any = MISSING
    trace: TraceConfig = field(default_factory=TraceConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    prompts: Optional[List[Any]] = None      # strings, token-id lists ([[5, 6, 7]]) or {prompt: ...} objects
    prompts_file: Optional[str] = None
    gen_length: int = 16
    seed: int = 0
    device: str = "auto"
    dtype: str = "auto"
    batch_size: int = 8
    threads: Optional[int] = None            # torch's intra-op CPU threads while decoding; null = torch's default
    fast: bool = True                        # the loop's host-count shortcuts (dlm_engine/core/fast); false: the
                                             # plain path, same tokens and metrics (docs/architecture.md)
    progress: bool = True                    # a bar on a terminal; elsewhere a log line every progress_interval s
    progress_interval: float = 30.0          # seconds between progress log lines without a terminal
    print_outputs: Optional[bool] = None     # one line per prompt; null = yes for a single run, no in a multirun
    resume: bool = True                      # multirun: skip a job whose result.json exists (same config)


def model_preset(name: str):
    """The ``model`` config node of the preset ``conf/model/<name>.yaml`` merged onto its schema
    (:class:`ModelConfig`: the defaults a preset does not restate), without composing a run."""
    from importlib.resources import files

    from omegaconf import OmegaConf

    node = OmegaConf.load(str(files("dlm_engine.conf") / "model" / f"{name}.yaml"))
    node.pop("defaults", None)
    return OmegaConf.merge(OmegaConf.structured(ModelConfig), node)


_registered = False


def register_resolvers() -> None:
    """OmegaConf resolvers used in conf/; idempotent. Runs on ``import dlm_engine`` so that launcher
    workers (joblib, submitit) have them before they resolve a job's config."""
    from omegaconf import OmegaConf

    from dlm_engine.checkpoints import embedded_path

    if not OmegaConf.has_resolver("dlm_embedded"):
        OmegaConf.register_new_resolver("dlm_embedded", lambda name: embedded_path(name) or f"<missing embedded checkpoint '{name}'>")
    if not OmegaConf.has_resolver("dlm_job_dir"):  # hydra.sweep.subdir (conf/hydra/output/dlm.yaml)
        OmegaConf.register_new_resolver("dlm_job_dir", _job_dir)
    if not OmegaConf.has_resolver("dlm_config_groups"):  # `dlm --help` (conf/hydra/help/dlm.yaml)
        OmegaConf.register_new_resolver("dlm_config_groups", config_groups_text)


def config_groups_text() -> str:
    """``group: option, ...`` lines of every config group a user picks from (not ``hydra/*``, not the
    dataclass schemas under ``schema/``), from the config loader of the running Hydra app."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.object_type import ObjectType

    gh = GlobalHydra.instance()
    if not gh.is_initialized():
        return ""
    loader = gh.config_loader()

    def groups(parent: str = ""):
        for g in loader.list_groups(parent):
            name = f"{parent}/{g}" if parent else g
            if name in ("hydra", "schema"):
                continue
            if loader.get_group_options(name, ObjectType.CONFIG):
                yield name
            yield from groups(name)

    return "\n".join(f"{g}: {', '.join(sorted(loader.get_group_options(g, ObjectType.CONFIG)))}"
                     for g in sorted(set(groups())))


def _job_dir(overrides=()) -> str:
    from dlm_engine.app.jobs import job_dirname

    return job_dirname(overrides)


_register_lock = threading.Lock()


def register_configs() -> None:
    """Store the schemas in Hydra's ConfigStore, once per process; thread safe (the flag is set after the work,
    so a second thread never composes before the schemas are there)."""
    global _registered
    if _registered:
        return
    with _register_lock:
        if _registered:
            return
        from hydra.core.config_store import ConfigStore

        register_resolvers()
        cs = ConfigStore.instance()
        cs.store(name="run_schema", node=RunConfig)
        cs.store(group="schema", name="model", node=ModelConfig)
        cs.store(group="schema", name="trace", node=TraceConfig)
        cs.store(group="schema", name="task", node=TaskConfig)
        _registered = True


INT64_MAX = (1 << 63) - 1


def check_known_keys(cfg, schema=None) -> None:
    """Every key of the composed config is a field of its schema. Hydra's schemas reject a misspelt key, but one
    added with ``+`` (``+strategy.treshold=0.7``, or the Python API's overrides) is taken as it is: it would be
    recorded in summary.json while decoding at the default. Raises ConfigError naming the key (with a "did you
    mean"). ``schema``: the dataclass of the top level (default :class:`RunConfig`; ``dlm-serve``'s extends it)."""
    import dataclasses

    from dlm_engine.app.compose import _suggest
    from dlm_engine.core.registry import cache_class, strategy_class
    from dlm_engine.errors import ConfigError

    def fields(schema) -> list:
        return [f.name for f in dataclasses.fields(schema)]

    def check(node, keys, where: str, also=()) -> None:
        for key in node.keys():
            if key not in keys and key not in also:
                hint = _suggest(str(key), keys)
                full = f"{where}.{key}" if where else str(key)
                raise ConfigError(f"{full}: unknown key" + (f"; did you mean {where + '.' if where else ''}{hint}?"
                                                            if hint else f" (keys of {where or 'the run config'}: "
                                                            f"{', '.join(keys)})"))

    check(cfg, fields(schema or RunConfig), "", also=("hydra",))   # (a sweep's checks compose the jobs with Hydra's node)
    groups = {"model": ModelConfig, "trace": TraceConfig, "task": TaskConfig}
    try:
        groups["strategy"] = strategy_class(str(cfg.strategy.name)).Config
        groups["cache"] = cache_class(str(cfg.cache.name)).Config
    except Exception:   # an unknown name is reported where the strategy/cache is built
        pass
    for group, schema in groups.items():
        node = cfg.get(group)
        if node is not None and hasattr(node, "keys") and dataclasses.is_dataclass(schema):
            check(node, fields(schema), group)


def check_values(cfg) -> None:
    """Value checks Hydra's types cannot make, over the whole composed config: a NaN or infinite float in any
    option (``strategy.temperature=nan`` would decode garbage), an integer beyond 64 bits, and a seed
    (``seed``, ``*_seed``) outside 0..2**63-1. Raises ConfigError naming the key."""
    from omegaconf import OmegaConf

    from dlm_engine.errors import ConfigError

    try:
        data = OmegaConf.to_container(cfg, resolve=True)
    except Exception:  # an unresolvable interpolation is reported where it is used; check the literal values
        data = OmegaConf.to_container(cfg, resolve=False)
    todo = [("", data)]
    while todo:
        path, node = todo.pop()
        if isinstance(node, dict):
            todo.extend((f"{path}.{k}" if path else str(k), v) for k, v in node.items())
        elif isinstance(node, list):
            todo.extend((f"{path}[{i}]", v) for i, v in enumerate(node))
        elif isinstance(node, float) and not math.isfinite(node):
            raise ConfigError(f"{path}={node} is not a finite number")
        elif isinstance(node, int) and not isinstance(node, bool):
            name = path.rsplit(".", 1)[-1]
            if (name == "seed" or name.endswith("_seed")) and not 0 <= node <= INT64_MAX:
                raise ConfigError(f"{path}={node} is outside 0..{INT64_MAX} (2**63 - 1)")
            if not -INT64_MAX - 1 <= node <= INT64_MAX:
                raise ConfigError(f"{path}={node} does not fit in 64 bits")
