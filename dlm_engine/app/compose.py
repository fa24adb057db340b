"""The ``dlm`` config outside the ``dlm`` command (Python API, lm-eval adapter, sweep checks), and Hydra's
config errors as one line with a "did you mean" where a close match exists.

:func:`compose` runs Hydra's own compose over the packaged ``conf/`` (the same schemas, presets and defaults as
the command line); :func:`describe_config_error` turns the errors Hydra raises for an unknown group option, an
unknown key, a wrong type or an unparsable override into one line that names the key.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import re
import threading
from typing import Any, Iterable, List, Optional

from dlm_engine.errors import ConfigError

_PLAIN = re.compile(r"[A-Za-z0-9_./:+\-@]*")


def to_override(key: str, value: Any, quote: bool = True) -> str:
    """``key=value`` in Hydra's override grammar. ``quote``: strings with special characters (or spelling
    null/true/false) are quoted so they stay strings; ``quote=False`` passes text through as override text
    (lm-eval's ``model_args``, which are ``dlm`` overrides)."""
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif value is None:
        text = "null"
    elif isinstance(value, (int, float)):
        text = repr(value)
    elif isinstance(value, (list, tuple, dict)):
        text = json.dumps(value)
    else:
        text = str(value)
        if quote and (not _PLAIN.fullmatch(text) or text.lower() in ("null", "true", "false") or not text):
            text = "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return f"{key}={text}"


_COMPOSE_LOCK = threading.RLock()


def compose(overrides: Iterable[str] = ()):
    """The run config ``dlm OVERRIDES`` would run (no Hydra run directory); :class:`ConfigError` on bad
    overrides, with the one line :func:`describe_config_error` gives."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    from dlm_engine.app.config import register_configs
    from dlm_engine.core.registry import load_plugins

    load_plugins()
    register_configs()
    overrides = list(overrides)
    # Hydra's GlobalHydra is one per process: two threads composing at once cleared and initialised it under each
    # other ("GlobalHydra is already initialized"), so compositions take turns
    with _COMPOSE_LOCK:
        if GlobalHydra.instance().is_initialized():
            GlobalHydra.instance().clear()
        try:
            with initialize_config_module("dlm_engine.conf", version_base="1.3"):
                return hydra_compose("config", overrides=overrides)
        except Exception as exc:
            raise ConfigError(one_line(exc)) from None


def one_line(exc: Exception) -> str:
    """:func:`describe_config_error`, re-raising ``exc`` when it is not a config error."""
    message = describe_config_error(exc)
    if message is None:
        raise exc
    return message


def _suggest(word: str, options: Iterable[str]) -> Optional[str]:
    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return close[0] if close else None


def _visible(options: Iterable[str]) -> List[str]:
    return [o for o in options if not str(o).endswith("_schema")]


def _keys_of(object_type: Any) -> List[str]:
    if isinstance(object_type, type) and dataclasses.is_dataclass(object_type):
        return [f.name for f in dataclasses.fields(object_type)]
    return []


def describe_config_error(exc: BaseException) -> Optional[str]:
    """One line for a Hydra/OmegaConf config error (None when ``exc`` is not one)."""
    from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

    if isinstance(exc, MissingConfigException):
        missing = str(getattr(exc, "missing_cfg_file", "") or "")
        group, _, name = missing.rpartition("/")
        options = _visible(getattr(exc, "options", None) or [])
        if group and options:
            hint = _suggest(name, options)
            line = f"{group}={name}: no such {group} (choose from {', '.join(options)})"
            return line + (f"; did you mean {group}={hint}?" if hint else "")
        return _first_line(str(exc))
    if isinstance(exc, OverrideParseException):
        override = getattr(exc, "override", None)
        return (f"cannot parse the override {override!r}: {_first_line(str(exc))} "
                "(quote values with special characters, e.g. 'prompts=[\"12+34=\"]')")
    cause = exc.__cause__ if isinstance(exc, ConfigCompositionException) else exc
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)) and getattr(cause, "full_key", None):
        full_key = str(getattr(cause, "full_key", "") or "")
        parent, _, key = full_key.rpartition(".")
        keys = _keys_of(getattr(cause, "object_type", None))
        hint = _suggest(key, keys)
        where = f"{parent}." if parent else ""
        line = f"{full_key}: unknown key"
        if hint:
            return line + f"; did you mean {where}{hint}?"
        return line + (f" (keys of {parent or 'the run config'}: {', '.join(keys)})" if keys else "")
    if isinstance(cause, ValidationError):
        full_key = str(getattr(cause, "full_key", "") or "")
        return f"{full_key}: {_first_line(str(cause))}" if full_key else _first_line(str(cause))
    if isinstance(exc, (ConfigCompositionException, OmegaConfBaseException)):
        return _first_line(str(exc))
    from hydra.errors import HydraException

    if isinstance(exc, HydraException):
        return _first_line(str(exc))
    return None


def _first_line(text: str) -> str:
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    return lines[0] if lines else str(text)
