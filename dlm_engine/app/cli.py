"""The ``dlm`` console script: a Hydra app over :mod:`dlm_engine.app.run`."""
from __future__ import annotations

import os
import shutil
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402


def _fail(message: str, out_dir, code: int = 2) -> None:
    """One line on stderr, no traceback, and no run directory left that could pass for a result."""
    print(f"dlm: error: {message}", file=sys.stderr)
    if out_dir is not None and os.path.isdir(out_dir) and not os.path.exists(os.path.join(out_dir, "summary.json")):
        shutil.rmtree(out_dir, ignore_errors=True)
    sys.stdout.flush()
    sys.exit(code)


@hydra.main(version_base="1.3", config_path="pkg://dlm_engine.conf", config_name="config")
def _hydra_main(cfg: DictConfig) -> None:
    from pathlib import Path

    from hydra.core.hydra_config import HydraConfig

    from dlm_engine.app.run import run
    from dlm_engine.errors import UserError

    from dlm_engine.sweeps.jobs import JobRecord

    out_dir = Path(HydraConfig.get().runtime.output_dir)
    from dlm_engine.sweeps.worker import exit_with_parent, uses_local_pool

    if uses_local_pool():
        exit_with_parent()  # a killed `dlm -m hydra/launcher=joblib` must not leave its workers decoding
    job = JobRecord(cfg, out_dir)  # multirun: resume check, result.json / error.json
    if job.should_skip():
        return
    job.start()
    try:
        job.finish(run(cfg, out_dir))
        if not job.multirun:  # a sweep's jobs are listed by the sweep summary instead
            import logging

            logging.getLogger("dlm_engine.run").info(f"outputs: {out_dir.resolve()}")
    except Exception as exc:  # in a multirun, a failed job must not end the other jobs of the sweep
        if job.multirun:
            job.fail(exc)  # error.json + one line; the sweep callback lists it and exits non-zero
            if isinstance(exc, UserError):
                return
            raise
        if not isinstance(exc, UserError):
            raise
        _fail(str(exc), out_dir)
    except KeyboardInterrupt:
        partial = sorted(out_dir.glob("*.partial"))  # a flushed trace of what was decoded: keep the run dir
        _fail("interrupted" + (f" (partial trace kept: {partial[0]})" if partial else ""),
              None if partial else out_dir, code=130)


def main() -> None:
    from dlm_engine.app.compose import describe_config_error
    from dlm_engine.app.config import register_configs
    from dlm_engine.core.registry import load_plugins
    from dlm_engine.errors import UserError

    try:
        load_plugins()
    except UserError as exc:
        _fail(str(exc), None)
    register_configs()
    full_error = os.environ.get("HYDRA_FULL_ERROR") == "1"
    # Hydra prints its config errors over several lines and exits 1; with HYDRA_FULL_ERROR they reach us
    # instead, and become one line (exit 2). A user who set HYDRA_FULL_ERROR=1 gets Hydra's full report.
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        _hydra_main()
    except BrokenPipeError:  # `dlm --help | head`, `dlm | head`: the reader is gone, nothing to report
        _silence_stdout()
        sys.exit(0)
    except Exception as exc:
        message = None if full_error else describe_config_error(exc)
        if message is None:
            raise
        _fail(message, None)


def _silence_stdout() -> None:
    """After a broken pipe: point stdout at /dev/null so that the interpreter's final flush stays quiet."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    main()
