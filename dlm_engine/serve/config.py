"""The ``dlm-serve`` config: the ``dlm`` run config plus the server's options, and the per-request options.

A request's decoding settings are composed exactly as ``dlm`` composes a command line
(:func:`dlm_engine.app.compose.compose` + :func:`dlm_engine.app.run.validate`): the server's own overrides, then
the request's (``max_tokens`` -> ``gen_length``, ``seed``, ``temperature``/``top_p`` -> the strategy's options of
those names, and the ``dlm`` object of the body). A bad value is the one line ``dlm`` prints, as a 400.
"""
from __future__ import annotations

import dataclasses
import json
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from dlm_engine.app.config import RunConfig
from dlm_engine.errors import ConfigError, UserError


@dataclass
class ServeConfig(RunConfig):
    host: str = "127.0.0.1"
    port: int = 8000
    max_batch_size: int = 8
    max_batch_wait: float = 0.0
    queue_size: int = 64
    request_timeout: float = 300.0
    max_prompt_chars: int = 100000
    max_body_bytes: int = 1 << 20
    served_model_name: Optional[str] = None
    log_level: str = "warning"


RUN_KEYS = {f.name for f in dataclasses.fields(RunConfig)}
SERVER_KEYS = tuple(f.name for f in dataclasses.fields(ServeConfig) if f.name not in RUN_KEYS)
# serving options of the `dlm` object that are not decoding settings
STREAM_KEYS = ("stream_steps",)
# run-config keys a request may set through `dlm` (others -- model, device, trace, ... -- are the server's)
REQUEST_TOP_KEYS = ("gen_length", "seed")

_registered = False
_lock = threading.Lock()


def register() -> None:
    global _registered
    with _lock:
        if _registered:
            return
        from hydra.core.config_store import ConfigStore

        from dlm_engine.app.config import register_configs

        register_configs()
        ConfigStore.instance().store(name="serve_schema", node=ServeConfig)
        _registered = True


def check_server(cfg) -> None:
    """The server's own options; ConfigError naming the key."""
    if not 0 <= int(cfg.port) <= 65535:
        raise ConfigError(f"port={cfg.port} is outside 0..65535")
    for key in ("max_batch_size", "queue_size", "max_prompt_chars", "max_body_bytes"):
        if int(cfg[key]) <= 0:
            raise ConfigError(f"{key}={cfg[key]} must be a positive integer")
    for key in ("max_batch_wait", "request_timeout"):
        v = float(cfg[key])
        if not math.isfinite(v) or v < 0 or (key == "request_timeout" and v == 0):
            raise ConfigError(f"{key}={cfg[key]} must be a {'positive' if key == 'request_timeout' else 'non-negative'} "
                              "number of seconds")
    if str(cfg.log_level) not in ("critical", "error", "warning", "info", "debug", "trace"):
        raise ConfigError(f"log_level={cfg.log_level} (choose critical, error, warning, info, debug or trace)")


def base_overrides(task_overrides: List[str]) -> List[str]:
    """The server's command-line overrides that a request's ``dlm`` config starts from (the server's own keys
    dropped: they are not ``dlm`` keys)."""
    out = []
    for o in task_overrides:
        key = o.split("=", 1)[0].lstrip("+~")
        if key in SERVER_KEYS:
            continue
        out.append(o)
    return out


def _fields(cls) -> List[str]:
    return [f.name for f in dataclasses.fields(cls)] if dataclasses.is_dataclass(cls) else []


class RequestConfigs:
    """Composes and validates the run config of a request's settings; the last ones composed are kept (a Hydra
    compose costs milliseconds, the same settings come again and again)."""

    def __init__(self, base: List[str], server_cfg, keep: int = 256):
        from omegaconf import OmegaConf

        self.base = list(base)
        self.server = server_cfg
        self.default_strategy = str(server_cfg.strategy.name)
        self.default_cache = str(server_cfg.cache.name)
        self.trace = OmegaConf.to_container(server_cfg.trace)
        self._memo: "OrderedDict[str, Any]" = OrderedDict()
        self._keep = keep
        self._lock = threading.Lock()

    def overrides(self, options: Dict[str, Any]) -> List[str]:
        """``dlm`` override strings for a request's settings (``options``: the ``dlm`` object without the
        serving keys, plus ``gen_length``/``seed``/``temperature``/``top_p`` from the OpenAI fields). Flat keys
        are the strategy's options, then the cache's; dotted keys (``strategy.threshold``) and
        ``strategy``/``cache`` as a name or a ``{"name": ..., option: value}`` object are taken as ``dlm``
        takes them."""
        from dlm_engine.app.compose import to_override
        from dlm_engine.core.registry import cache_class, strategy_class

        opts = dict(options)
        out: List[str] = []
        base = list(self.base)
        strategy, cache = self.default_strategy, self.default_cache
        for group in ("strategy", "cache"):
            value = opts.pop(group, None)
            if value is None:
                continue
            if isinstance(value, dict):
                value = dict(value)
                name = value.pop("name", None)
                for k, v in value.items():
                    opts[f"{group}.{k}"] = v
                if name is None:
                    continue
                value = name
            if not isinstance(value, str):
                raise ConfigError(f"dlm.{group}: expected a preset name or an object, got {type(value).__name__}")
            if value == (strategy if group == "strategy" else cache):
                continue             # the server's preset, with the server's options
            if group == "strategy":
                strategy = value
            else:
                cache = value
            # another preset: the server's options of the old one do not apply to it
            base = [o for o in base if not o.split("=", 1)[0].lstrip("+~").startswith(group)]
            out.append(to_override(group, value))
        try:
            s_keys = _fields(strategy_class(strategy).Config)
        except Exception:
            s_keys = []        # an unknown preset: compose names it
        try:
            c_keys = _fields(cache_class(cache).Config)
        except Exception:
            c_keys = []
        for key, value in opts.items():
            if "." in key:
                group = key.split(".", 1)[0]
                if group not in ("strategy", "cache"):
                    raise ConfigError(f"dlm.{key}: a request sets strategy.* and cache.* options only "
                                      "(model, device and trace are the server's)")
                out.append(to_override(key, value))
            elif key in REQUEST_TOP_KEYS:
                out.append(to_override(key, value))
            elif key in s_keys and key != "name":
                out.append(to_override(f"strategy.{key}", value))
            elif key in c_keys and key != "name":
                out.append(to_override(f"cache.{key}", value))
            else:
                import difflib

                known = [k for k in s_keys + c_keys if k != "name"] + list(REQUEST_TOP_KEYS) + list(STREAM_KEYS)
                close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
                hint = f"; did you mean dlm.{close[0]}?" if close else \
                    f" (options of strategy={strategy} and cache={cache}: {', '.join(sorted(set(known)))})"
                raise ConfigError(f"dlm.{key}: unknown key{hint}")
        base = [o for o in base if o.split("=", 1)[0].lstrip("+~") not in ("trace.record", "progress", "print_outputs")]
        return base + ["progress=false", "print_outputs=false", to_override("trace.record", bool(self.trace["record"]))] + out

    def known(self, options: Dict[str, Any]) -> bool:
        """Whether these settings were composed before (:meth:`get` then costs no compose)."""
        return json.dumps(options, sort_keys=True, default=str) in self._memo

    def get(self, options: Dict[str, Any]):
        """The validated run config of these settings (ConfigError/UserError with one line)."""
        key = json.dumps(options, sort_keys=True, default=str)
        with self._lock:
            hit = self._memo.get(key)
            if hit is not None:
                self._memo.move_to_end(key)
                return hit
        from dlm_engine.app.compose import compose
        from dlm_engine.app.run import validate

        cfg = compose(self.overrides(options))
        validate(cfg)
        with self._lock:
            self._memo[key] = cfg
            while len(self._memo) > self._keep:
                self._memo.popitem(last=False)
        return cfg


def batch_key(cfg) -> str:
    """Requests with the same key share a decode: the same strategy, cache, generation length and seed."""
    from omegaconf import OmegaConf

    return json.dumps({"strategy": OmegaConf.to_container(cfg.strategy, resolve=True),
                       "cache": OmegaConf.to_container(cfg.cache, resolve=True),
                       "gen_length": int(cfg.gen_length), "seed": int(cfg.seed), "threads": cfg.threads},
                      sort_keys=True, default=str)


# (strategy, cache) pairs whose rows interact in a batch (reference semantics; tests/test_batch_invariance.py
# lists them): requests decoded with them get a decode of their own, so that each answer equals decoding it alone
_INTERACTING_CACHES = {"d2cache"}
_INTERACTING_PAIRS = {("block_buffer", "prefix"), ("block_buffer", "dual"), ("block_buffer", "block_store")}


def batch_limit(cfg, strategy, max_batch_size: int) -> Tuple[int, Optional[str]]:
    """How many requests with this config may share a decode, and why it is 1 when it is."""
    name, cache = str(cfg.strategy.name), str(cfg.cache.name)
    if strategy.max_batch is not None and strategy.max_batch <= 1:
        return 1, f"strategy={name} decodes one sequence at a time"
    if cache in _INTERACTING_CACHES:
        return 1, f"cache={cache} makes the rows of a batch interact"
    if (name, cache) in _INTERACTING_PAIRS:
        return 1, f"strategy={name} with cache={cache} makes the rows of a batch interact"
    if cfg.strategy.get("gamma") is not None \
            and not cfg.strategy.get("eb_cummax_over_ranks", False):
        return 1, "EB-Sampler's running maximum over the batch makes rows interact (eb_cummax_over_ranks=false)"
    limit = int(max_batch_size)
    if strategy.max_batch is not None:
        limit = min(limit, int(strategy.max_batch))
    return max(1, limit), None


def check_user_error(exc: BaseException) -> Optional[str]:
    if isinstance(exc, (ConfigError, UserError)):
        return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return None
