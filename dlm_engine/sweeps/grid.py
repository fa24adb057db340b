"""The jobs of a sweep, known before any of them runs: the grid of a multirun config (the basic sweeper's
cartesian product of ``hydra.sweeper.params`` and the command's overrides), each job's composed config, and
the check of every job's config before the first job starts.

Used by the end-of-multirun callback at the start of a sweep (:func:`check_jobs`) and by ``dlm-sweep``, which
reads the grid of an interrupted sweep from its ``multirun.yaml`` to list the jobs that never started.
"""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional, Tuple


def is_basic_sweeper(config) -> bool:
    from omegaconf import OmegaConf

    target = str(OmegaConf.select(config, "hydra.sweeper._target_", default="") or "")
    return target.endswith("BasicSweeper")


def config_loader(config=None):
    """Hydra's config loader: the running app's, else one over the config sources a multirun.yaml recorded
    (the packaged ``conf/`` when it recorded none)."""
    from hydra.core.global_hydra import GlobalHydra

    from dlm_engine.app.config import register_configs
    from dlm_engine.core.registry import load_plugins

    load_plugins()
    register_configs()
    if GlobalHydra.instance().is_initialized():
        return GlobalHydra.instance().config_loader()
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.config_search_path_impl import ConfigSearchPathImpl
    from hydra._internal.utils import create_config_search_path
    from omegaconf import OmegaConf

    from hydra.core.plugins import Plugins

    Plugins.instance()  # registers the config source types (pkg://, file://, structured://)
    sources = OmegaConf.select(config, "hydra.runtime.config_sources", default=None) if config is not None else None
    if sources:
        search = ConfigSearchPathImpl()
        for src in sources:
            search.append(str(src.provider), f"{src.schema}://{src.path}")
    else:
        search = create_config_search_path("pkg://dlm_engine.conf")
    return ConfigLoaderImpl(config_search_path=search)


def expand(config, loader) -> Optional[List[List[str]]]:
    """Every job's overrides, in the order the basic sweeper launches them (None for other sweepers)."""
    if not is_basic_sweeper(config):
        return None
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    params = OmegaConf.select(config, "hydra.sweeper.params", default=None) or {}
    arguments = [f"{k}={v}" for k, v in params.items()]
    arguments += [str(o) for o in OmegaConf.select(config, "hydra.overrides.task", default=None) or []]
    parsed = OverridesParser.create(config_loader=loader).parse_overrides(arguments)
    return [list(job) for job in BasicSweeper.split_arguments(parsed, None)[0]]


def check_jobs(config) -> Tuple[int, List[Tuple[List[str], str]]]:
    """Compose and :func:`~dlm_engine.app.run.validate` every job of a basic-sweeper multirun; returns
    (number of jobs, [(job overrides, one-line problem)]). Nothing is loaded or written."""
    from dlm_engine.app.compose import one_line
    from dlm_engine.app.run import validate
    from dlm_engine.errors import UserError

    loader = config_loader(config)
    jobs = expand(config, loader)
    if jobs is None:
        return 0, []
    problems = []
    for job in jobs:
        try:
            validate(loader.load_sweep_config(master_config=config, sweep_overrides=job))
        except UserError as exc:
            problems.append((job, str(exc)))
        except Exception as exc:
            problems.append((job, one_line(exc)))
    return len(jobs), problems


def swept_part(job: List[str], jobs: List[List[str]]) -> str:
    """The overrides of ``job`` whose values differ between ``jobs`` (all of them when none differ)."""
    from dlm_engine.app.jobs import split_override

    values = {}
    for j in jobs:
        for ov in j:
            key, val = split_override(ov)
            values.setdefault(key, set()).add(val)
    shown = [ov for ov in job if len(values.get(split_override(ov)[0], ())) > 1]
    return " ".join(shown or job)


def read_grid(root: Path) -> Optional[List[List[str]]]:
    """The jobs of the sweep whose ``multirun.yaml`` lies in ``root`` (None when there is none, or when it
    was not run by the basic sweeper)."""
    path = Path(root) / "multirun.yaml"
    if not path.is_file():
        return None
    from omegaconf import OmegaConf

    config = OmegaConf.load(path)
    return expand(config, config_loader(config))
