"""Glue between ``dlm`` runs and traces: provenance header, the run's recorder, config from a header. It lives in
the app (it reads run configs, which the trace package below it never does); the verified re-run of a recorded
decode is :mod:`dlm_engine.app.rerun`."""
from __future__ import annotations

import base64
import functools
import hashlib
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence

from dlm_engine.trace import format as fmt

if TYPE_CHECKING:  # the recorder (and its numpy/zstd imports) loads only when a run records
    from dlm_engine.trace.recorder import TraceRecorder


def check_config(trace_cfg) -> None:
    """Validate the ``trace`` config group before any model is loaded (ConfigError names the key)."""
    from dlm_engine.errors import ConfigError

    if trace_cfg.capture not in fmt.CAPTURE_LEVELS:
        raise ConfigError(f"trace.capture={trace_cfg.capture} is not one of {', '.join(fmt.CAPTURE_LEVELS)}")
    if int(trace_cfg.topk) <= 0:
        raise ConfigError(f"trace.topk={trace_cfg.topk} must be a positive integer")
    if not float(trace_cfg.logit_error_bound) > 0:
        raise ConfigError(f"trace.logit_error_bound={trace_cfg.logit_error_bound} must be > 0")
    if int(trace_cfg.queue_size) <= 0:
        raise ConfigError(f"trace.queue_size={trace_cfg.queue_size} must be a positive integer")
    name = str(trace_cfg.filename)
    if not name or os.sep in name or name in (".", ".."):
        raise ConfigError(f"trace.filename='{name}' must be a plain file name (it is written in the run directory)")


def batch_rows(cfg, prompts: Optional[int]) -> int:
    """The most rows one batch of the run holds: ``batch_size``, or fewer when there are fewer prompts."""
    bs = int(cfg.batch_size)
    return max(1, min(bs, int(prompts))) if prompts is not None else bs


def check_batch_size(cfg, prompts: Optional[int]) -> None:
    """A recorded run's batches fit what a trace holds (``MAX_BATCH`` rows a batch); ``prompts``: how many the run
    decodes, None when not known yet. ConfigError in the run's own terms."""
    from dlm_engine.errors import ConfigError
    from dlm_engine.trace.reader import MAX_BATCH

    if cfg.trace.record and batch_rows(cfg, prompts) > MAX_BATCH:
        raise ConfigError(f"batch_size={int(cfg.batch_size)} is more than a trace records in one batch "
                          f"({MAX_BATCH} rows): use batch_size<={MAX_BATCH}, or trace.record=false")


@functools.lru_cache(maxsize=1)
def git_commit() -> Dict[str, Any]:
    """Commit of the source tree dlm_engine runs from (editable installs), if git knows it."""
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        if head.returncode != 0:
            return {"commit": None}
        dirty = subprocess.run(["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
        return {"commit": head.stdout.strip(), "dirty": bool(dirty.stdout.strip()) if dirty.returncode == 0 else None}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None}


def rng_state(seed: Optional[int] = None) -> Dict[str, Any]:
    """The generator state a decode starts from. The CPU state (5,056 bytes, 6.7 KB in base64: most of a
    header) is written only when ``torch.manual_seed(seed)`` does not rebuild it; ``fingerprint`` is what
    the batch records compare their states with (:func:`records.rng_fingerprint` of CPU + CUDA state)."""
    import torch

    from dlm_engine.trace.records import rng_fingerprint

    cpu = torch.random.get_rng_state().numpy().tobytes()
    out: Dict[str, Any] = {"torch_cpu_sha256": hashlib.sha256(cpu).hexdigest()}
    if seed is not None and cpu == torch.Generator().manual_seed(int(seed)).get_state().numpy().tobytes():
        out["torch_cpu_seed"] = int(seed)
    else:
        out["torch_cpu_b64"] = base64.b64encode(cpu).decode()
    cuda = b""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = torch.cuda.get_rng_state().numpy().tobytes()
        out["torch_cuda_b64"] = base64.b64encode(cuda).decode()
    out["fingerprint"] = rng_fingerprint(cpu + cuda).hex()
    return out


def restore_rng(state: Dict[str, Any]) -> None:
    """Set the generators to a header's ``rng`` state (a CPU state given by its seed is rebuilt, and must
    have the recorded SHA-256)."""
    import binascii

    import torch

    from dlm_engine.errors import UserError

    try:
        if state.get("torch_cpu_b64"):
            raw = base64.b64decode(state["torch_cpu_b64"], validate=True)
            torch.random.set_rng_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
        elif "torch_cpu_seed" in state:
            seed = state["torch_cpu_seed"]
            if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 1 << 64:
                raise ValueError(f"torch_cpu_seed {seed!r} is not a seed")
            raw = torch.Generator().manual_seed(seed).get_state()
            if hashlib.sha256(raw.numpy().tobytes()).hexdigest() != state.get("torch_cpu_sha256"):
                raise ValueError("the state torch_cpu_seed builds does not have the recorded torch_cpu_sha256")
            torch.random.set_rng_state(raw)
        if state.get("torch_cuda_b64") and torch.cuda.is_available():
            raw = base64.b64decode(state["torch_cuda_b64"], validate=True)
            torch.cuda.set_rng_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    except (binascii.Error, TypeError, ValueError, RuntimeError) as exc:
        raise UserError(f"the trace's recorded RNG state cannot be restored ({str(exc).splitlines()[0][:120]})") from None


def hydra_overrides() -> List[str]:
    try:
        from hydra.core.hydra_config import HydraConfig

        return list(HydraConfig.get().overrides.task)
    except Exception:
        return []


def build_header(cfg, lm, rows_expected: Optional[int] = None, prompt_length: Optional[int] = None) -> Dict[str, Any]:
    """Provenance of a run: package, git, model + weights digest, tokenizer, config, seed + RNG state, ...

    ``shape`` holds the facts a reader bounds its decoding by (see ``reader.Limits``): the vocabulary
    (logits width), rows per batch, the longest prompt (``prompt_length``, when known) and the generated
    positions per row."""
    import numpy
    import torch
    import transformers
    import zstandard
    from omegaconf import OmegaConf

    from dlm_engine import __version__

    # one resolution of the config: each read of an interpolated value (the embedded model's path) parses it again
    config = OmegaConf.to_container(cfg, resolve=True)
    model_path = (config.get("model") or {}).get("path") if isinstance(config, dict) else None
    resolved = str(Path(model_path).expanduser().resolve()) if model_path else None
    if lm.tokenizer_digest == "char-ascii-v1":
        tok = {"kind": "char", "digest": lm.tokenizer_digest}
    elif model_path and lm.tokenizer_digest:
        tok = {"kind": "hf", "path": resolved, "digest": lm.tokenizer_digest}
    else:
        tok = None
    now = time.time()
    return {
        "format": "dlm_engine trace",
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(now)),
        "created_unix": now,
        "package": {"name": "dlm_engine", "version": __version__, "git": dict(git_commit())},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "numpy": numpy.__version__,
                     "zstandard": zstandard.__version__, "python": platform.python_version()},
        "model": {"name": lm.name, "digest": lm.digest, "tokenizer_digest": lm.tokenizer_digest,
                  "mask_id": lm.mask_id, "eos_id": lm.eos_id, "pad_id": lm.pad_id, "vocab_size": vocab_size(lm),
                  "path": resolved},
        "tokenizer": tok,
        "config": config,
        "overrides": hydra_overrides(),
        "seed": int(cfg.seed),
        "rng": rng_state(int(cfg.seed)),
        "device": str(lm.device),
        "dtype": str(lm.dtype).replace("torch.", ""),
        "rows_expected": rows_expected,
        # the largest batch the run decodes (batch_size is only an upper bound: 100000 with 20 prompts decodes 20)
        "shape": {"vocab_size": vocab_size(lm), "batch_size": batch_rows(cfg, rows_expected),
                  "gen_length": int(cfg.gen_length),
                  "prompt_length": None if prompt_length is None else max(int(prompt_length), 1)},
    }


def vocab_size(lm) -> Optional[int]:
    """The width of the model's logits: the largest token id a decode can produce, plus one."""
    raw = getattr(lm, "config", None) or {}
    sizes = [v for v in (raw.get("vocab_size"), raw.get("embedding_size")) if isinstance(v, int) and v > 0]
    return max(sizes) if sizes else None


def open_run_recorder(cfg, out_dir, lm, prompt_ids: Sequence) -> Optional[TraceRecorder]:
    """The recorder of a ``dlm`` run (``None`` when ``trace.record=false``). Call right before decoding."""
    from dlm_engine.trace.recorder import TraceRecorder

    t = cfg.trace
    if not t.record:
        return None
    check_batch_size(cfg, len(prompt_ids))
    header = build_header(cfg, lm, rows_expected=len(prompt_ids),
                          prompt_length=max((len(p) for p in prompt_ids), default=1))
    return TraceRecorder(str(Path(out_dir) / t.filename), header, capture=t.capture, topk=t.topk,
                         logit_error_bound=t.logit_error_bound, queue_size=t.queue_size,
                         recomputed=bool(t.recomputed))


def config_from_header(header: Dict[str, Any]):
    """Rebuild the typed run config recorded in a header (schemas from the registries, values from the file)."""
    from omegaconf import OmegaConf

    from dlm_engine.app.config import ModelConfig, RunConfig, register_configs
    from dlm_engine.errors import UserError
    from dlm_engine.core.registry import cache_class, strategy_class

    register_configs()
    rec = header.get("config")
    if not isinstance(rec, dict):
        raise UserError("trace header has no recorded config")
    rec = dict(rec)
    try:
        groups = {"model": ModelConfig, "strategy": strategy_class(rec["strategy"]["name"]).Config,
                  "cache": cache_class(rec["cache"]["name"]).Config}
        top = {k: v for k, v in rec.items() if k not in groups}
        cfg = OmegaConf.merge(OmegaConf.structured(RunConfig), top)
        for k, schema in groups.items():
            node = OmegaConf.merge(OmegaConf.structured(schema), rec[k])
            OmegaConf.set_struct(cfg, False)
            cfg[k] = node
        OmegaConf.set_struct(cfg, True)
    except UserError:
        raise
    except Exception as exc:   # a config this version cannot rebuild (or a crafted one): one line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"the trace's recorded config cannot be rebuilt ({first})") from None
    return cfg
