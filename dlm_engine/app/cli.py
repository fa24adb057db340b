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
    """One line on stderr, no traceback, and no run directory left that could pass for a result (a directory
    holding an earlier run's outputs, set aside in ``.previous/``, is kept)."""
    print(f"dlm: error: {message}", file=sys.stderr)
    if out_dir is not None and os.path.isdir(out_dir) and not os.path.exists(os.path.join(out_dir, "summary.json")) \
            and not os.path.exists(os.path.join(out_dir, ".previous")):
        shutil.rmtree(out_dir, ignore_errors=True)
    sys.stdout.flush()
    sys.exit(code)


@hydra.main(version_base="1.3", config_path="pkg://dlm_engine.conf", config_name="config")
def _hydra_main(cfg: DictConfig) -> None:
    from pathlib import Path

    from hydra.core.hydra_config import HydraConfig

    from dlm_engine.errors import UserError
    from dlm_engine.app.jobs import JobRecord

    out_dir = Path(HydraConfig.get().runtime.output_dir)
    from dlm_engine.core.memory import keep_freed_memory

    keep_freed_memory()      # (launcher workers are processes of their own)
    from dlm_engine.app.worker import exit_with_parent, uses_local_pool

    if uses_local_pool():
        exit_with_parent()  # a killed `dlm -m hydra/launcher=joblib` must not leave its workers decoding
    job = JobRecord(cfg, out_dir)  # multirun: resume check, result.json / error.json
    try:
        if not job.claim():  # one writer per directory: another process runs this job (multirun: skipped)
            return
    except UserError as exc:
        _fail(str(exc), None)  # never remove a directory another process is writing
    try:
        _run_job(job, cfg, out_dir)
    finally:
        job.release()


def _run_job(job, cfg: DictConfig, out_dir) -> None:
    from dlm_engine.app.run import run
    from dlm_engine.errors import UserError
    from dlm_engine.fsutil import os_error_message

    if job.should_skip():
        return
    job.start()
    ran = False
    try:
        summary = run(cfg, out_dir)
        ran = True
        job.finish(summary)
        if not job.multirun:  # a sweep's jobs are listed by the sweep summary instead
            import logging

            logging.getLogger("dlm_engine.run").info(f"outputs: {out_dir.resolve()}")
    except Exception as exc:  # in a multirun, a failed job must not end the other jobs of the sweep
        if isinstance(exc, OSError):  # a full, read-only or missing output directory: path + errno text
            exc = UserError(os_error_message(exc, out_dir))
        if ran and not job.multirun:  # result.json could not be written: no completion marker either
            (out_dir / "summary.json").unlink(missing_ok=True)
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
    from dlm_engine.app.config import register_configs
    from dlm_engine.core.memory import keep_freed_memory
    from dlm_engine.core.registry import load_plugins
    from dlm_engine.errors import UserError

    keep_freed_memory()      # a step's large temporaries stay with the process (dlm_engine.core.memory)
    if "--version" in sys.argv[1:]:   # (Hydra's own flag prints Hydra's version)
        print(version_line())
        sys.exit(0)
    try:
        load_plugins()
    except UserError as exc:
        _fail(str(exc), None)
    register_configs()
    _run_hydra()


def version_line() -> str:
    """``dlm --version``: this package's version, with the Hydra it runs on."""
    import hydra as _hydra

    from dlm_engine import __version__

    return f"dlm_engine {__version__} (hydra {_hydra.__version__})"


def _run_hydra() -> None:
    """Hydra prints its config errors over several lines (exit 1) and a traceback for errors outside the task
    function, e.g. creating or writing the output directory (read-only, full disk, a path through a file). Ask
    it to re-raise instead: config errors become one line with a suggestion (exit 2), file-system errors one
    line naming the path. A user who set HYDRA_FULL_ERROR=1 gets Hydra's own full report."""
    import logging

    logging.raiseExceptions = False  # a log line that cannot be written (full disk) is not a second traceback
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        _hydra_main()
        return
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        _hydra_main()
    except BrokenPipeError:  # `dlm --help | head`, `dlm | head`: the reader is gone, nothing to report
        _silence_stdout()
        sys.exit(0)
    except Exception as exc:
        from dlm_engine.app.compose import describe_config_error

        message = describe_config_error(exc)
        if message is not None:
            _fail(message, None)
        from hydra.errors import CompactHydraException
        from omegaconf.errors import OmegaConfBaseException

        if isinstance(exc, CompactHydraException):  # (some are OSErrors too: checked first)
            print(str(exc), file=sys.stderr)
            if isinstance(exc.__cause__, OmegaConfBaseException):
                print(str(exc.__cause__), file=sys.stderr)
            sys.exit(1)
        if isinstance(exc, OSError):
            from dlm_engine.fsutil import os_error_message

            _fail(os_error_message(exc, _hydra_output_path(exc)), None)   # e.g. a full disk while writing .hydra/
        raise


def _silence_stdout() -> None:
    """After a broken pipe: point stdout at /dev/null so that the interpreter's final flush stays quiet."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def _hydra_output_path(exc: BaseException) -> str:
    """The file or directory Hydra was writing when a write failed without naming it (a full disk while
    writing ``.hydra/*.yaml``): from the failing frame's ``output_dir``/``filename``, else the run's directory."""
    path, tb = "", exc.__traceback__
    while tb is not None:
        loc = tb.tb_frame.f_locals
        if "output_dir" in loc:
            path = os.path.join(str(loc["output_dir"]), str(loc.get("filename", "")))
        tb = tb.tb_next
    if path:
        return path.rstrip(os.sep)
    try:
        from hydra.core.hydra_config import HydraConfig

        return str(HydraConfig.get().runtime.output_dir)
    except Exception:
        return ""


if __name__ == "__main__":
    main()
