"""The ``dlm-serve`` console script: a Hydra app (the ``dlm`` config groups and overrides plus the server's options,
``conf/serve.yaml``) that loads the model once and serves it over HTTP with uvicorn."""
from __future__ import annotations

import os
import sys
from typing import Optional

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402


def _fail(message: str, code: int = 2) -> None:
    print(f"dlm-serve: error: {message}", file=sys.stderr)
    sys.stdout.flush()
    sys.exit(code)


def build_server(cfg: DictConfig, out_dir, overrides=()):
    """The :class:`~dlm_engine.serve.app.Server` of a composed ``dlm-serve`` config (the model loaded, nothing
    listening yet): ``overrides`` are the command line's, which every request's config starts from."""
    from pathlib import Path

    import torch

    from dlm_engine.app.api import load_model
    from dlm_engine.app.run import validate
    from dlm_engine.serve.app import Server
    from dlm_engine.serve.config import RequestConfigs, ServeConfig, base_overrides, check_server
    from dlm_engine.serve.engine import Engine
    from dlm_engine.serve.metrics import ServeMetrics

    check_server(cfg)
    configs = RequestConfigs(base_overrides(list(overrides)), cfg)
    base = configs.get({})                 # the server's own decoding config, composed as a request's is
    validate(cfg, ServeConfig)
    torch.manual_seed(int(cfg.seed))
    lm = load_model(base.model, base.device, base.dtype)
    with torch.inference_mode():           # a first forward before the first request (allocations, kernels)
        from dlm_engine.core.canvas import Canvas

        c = Canvas.from_prompts([[lm.pad_id]], 1, lm.mask_id, lm.pad_id, device=lm.device)
        lm.model(c.tokens)
    metrics = ServeMetrics()
    engine = Engine(lm, configs, cfg, Path(out_dir), metrics)
    return Server(lm, configs, engine, metrics, cfg, Path(out_dir))


def serve(server, host: str, port: int, log_level: str = "warning", ready=None) -> None:
    """Run uvicorn on ``server`` until SIGINT/SIGTERM: it stops accepting, lets requests in flight finish (up
    to request_timeout), then the engine decodes what is queued and stops."""
    import uvicorn

    from dlm_engine.serve.app import create_app

    app = create_app(server)
    config = uvicorn.Config(app, host=host, port=int(port), log_level=log_level, lifespan="on",
                            timeout_graceful_shutdown=int(server.timeout) + 5, access_log=log_level in ("info", "debug"))
    userver = uvicorn.Server(config)
    if ready is not None:
        ready(userver)
    userver.run()


def compose_serve(overrides=()):
    """The ``dlm-serve`` config of these command-line overrides, without running the app (tests, benchmarks)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    from dlm_engine.app.compose import _COMPOSE_LOCK, one_line
    from dlm_engine.app.config import register_configs
    from dlm_engine.core.registry import load_plugins
    from dlm_engine.errors import ConfigError
    from dlm_engine.serve.config import register

    load_plugins()
    register_configs()
    register()
    with _COMPOSE_LOCK:
        if GlobalHydra.instance().is_initialized():
            GlobalHydra.instance().clear()
        try:
            with initialize_config_module("dlm_engine.conf", version_base="1.3"):
                return hydra_compose("serve", overrides=list(overrides))
        except Exception as exc:
            raise ConfigError(one_line(exc)) from None


class ServerThread:
    """A server on 127.0.0.1 in a thread of this process (tests, benchmarks)::

        with ServerThread(["strategy=threshold"], out_dir) as s:
            requests.post(s.url + "/v1/completions", ...)
    """

    def __init__(self, overrides=(), out_dir=".", port: Optional[int] = None):
        import socket

        self.overrides = list(overrides)
        if port is None:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
        self.port = int(port)
        self.url = f"http://127.0.0.1:{self.port}"
        self.cfg = compose_serve(self.overrides + [f"port={self.port}", "host=127.0.0.1"])
        self.server = build_server(self.cfg, out_dir, self.overrides)
        self._uv = None
        self._thread = None

    def __enter__(self) -> "ServerThread":
        import threading
        import time

        got = threading.Event()

        def ready(uv):
            self._uv = uv
            got.set()

        self._thread = threading.Thread(target=serve, args=(self.server, "127.0.0.1", self.port, "warning", ready),
                                        daemon=True)
        self._thread.start()
        got.wait(30)
        for _ in range(600):
            if self._uv is not None and self._uv.started:
                break
            time.sleep(0.01)
        else:
            raise RuntimeError("dlm-serve did not start")
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        if self._uv is not None:
            self._uv.should_exit = True
        if self._thread is not None:
            self._thread.join(60)


@hydra.main(version_base="1.3", config_path="pkg://dlm_engine.conf", config_name="serve")
def _hydra_main(cfg: DictConfig) -> None:
    import logging
    from pathlib import Path

    from hydra.core.hydra_config import HydraConfig

    from dlm_engine.errors import UserError

    hc = HydraConfig.get()
    out_dir = Path(hc.runtime.output_dir)
    try:
        server = build_server(cfg, out_dir, list(hc.overrides.task))
    except (UserError, OSError) as exc:
        import shutil

        if not (out_dir / "traces").exists():      # nothing was served: no run directory left behind
            shutil.rmtree(out_dir, ignore_errors=True)
        if isinstance(exc, OSError):
            from dlm_engine.fsutil import os_error_message

            _fail(os_error_message(exc, out_dir))
        _fail(str(exc))
    host, port = str(cfg.host), int(cfg.port)
    print(f"dlm-serve: serving '{server.name}' (strategy={cfg.strategy.name} cache={cfg.cache.name}) on "
          f"http://{host}:{port}  outputs: {out_dir}", file=sys.stderr, flush=True)
    logging.getLogger("dlm_engine.serve").info("serving on %s:%d", host, port)
    serve(server, host, port, str(cfg.log_level))


def main() -> None:
    from dlm_engine.app.config import register_configs
    from dlm_engine.core.memory import keep_freed_memory
    from dlm_engine.core.registry import load_plugins
    from dlm_engine.errors import UserError
    from dlm_engine.serve.config import register

    keep_freed_memory()
    try:
        load_plugins()
    except UserError as exc:
        _fail(str(exc))
    register_configs()
    register()
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        _hydra_main()
    except SystemExit:
        raise
    except Exception as exc:
        from dlm_engine.app.compose import describe_config_error

        message = describe_config_error(exc)
        if message is not None:
            _fail(message)
        raise


if __name__ == "__main__":
    main()
