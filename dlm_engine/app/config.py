"""Structured (dataclass) schemas of the top-level run config and the model group.

Strategy and cache schemas are stored by their registration decorators; these are stored by
:func:`register_configs`. YAML files in ``conf/`` extend the schemas, so unknown keys and wrong
types are rejected by Hydra itself.
"""
from __future__ import annotations

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


@dataclass
class TraceConfig:
    record: bool = True
    capture: str = "tokens"                  # tokens | confidence | topk | logits
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
    prompts: Optional[List[str]] = None
    prompts_file: Optional[str] = None
    gen_length: int = 16
    seed: int = 0
    device: str = "auto"
    dtype: str = "auto"
    batch_size: int = 8
    progress: bool = True                    # a bar on a terminal; elsewhere a log line every progress_interval s
    progress_interval: float = 30.0          # seconds between progress log lines without a terminal
    print_outputs: Optional[bool] = None     # one line per prompt; null = yes for a single run, no in a multirun
    resume: bool = True                      # multirun: skip a job whose result.json exists (same config)


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


def _job_dir(overrides=()) -> str:
    from dlm_engine.sweeps.jobs import job_dirname

    return job_dirname(overrides)


def register_configs() -> None:
    global _registered
    if _registered:
        return
    _registered = True
    from hydra.core.config_store import ConfigStore

    register_resolvers()
    cs = ConfigStore.instance()
    cs.store(name="run_schema", node=RunConfig)
    cs.store(group="model", name="model_schema", node=ModelConfig)
    cs.store(group="trace", name="trace_schema", node=TraceConfig)
    cs.store(group="task", name="task_schema", node=TaskConfig)
