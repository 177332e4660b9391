"""Run the app under uvicorn: build the engine, bind (loopback by default), serve until SIGTERM
or SIGINT, then drain: no new requests (503), in-flight ones get ``serve.shutdown_grace_s`` to
finish, the rest are aborted, the engine core stops and the process exits 0."""
from __future__ import annotations

import contextlib
import logging
import signal
import threading
from typing import Optional

import uvicorn

from megainfer.config import ConfigError, ServeConfig

from .app import build_app
from .engine_client import EngineClient

log = logging.getLogger("megainfer.serve")


def served_name(cfg: ServeConfig, model_path: Optional[str], family: str) -> str:
    """``serve.served_model_name``, else the model path as given, else megainfer-<family>."""
    return cfg.served_model_name or model_path or f"megainfer-{family}"


class DrainingServer(uvicorn.Server):
    """uvicorn's server whose first SIGTERM/SIGINT marks the engine client draining (new
    requests get 503) and starts uvicorn's graceful shutdown; unlike uvicorn's own handler it
    does not re-raise the signal afterwards, so a drained server exits 0."""

    def __init__(self, config: uvicorn.Config, client: EngineClient):
        super().__init__(config)
        self.client = client

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        sigs = (signal.SIGINT, signal.SIGTERM)
        old = {s: signal.signal(s, self.on_signal) for s in sigs}
        try:
            yield
        finally:
            for s, h in old.items():
                signal.signal(s, h)

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        for srv in self.servers:
            for sock in srv.sockets:
                host, port = sock.getsockname()[:2]
                print(f"[serve] {self.client.model_name!r} on http://{host}:{port}", flush=True)

    def on_signal(self, sig, frame) -> None:
        if self.should_exit:
            self.force_exit = True  # a second signal: stop waiting
            return
        log.info("[serve] %s: draining (grace %.1fs)", signal.Signals(sig).name,
                 self.config.timeout_graceful_shutdown or 0.0)
        self.client.draining = True
        self.should_exit = True


def make_server(client: EngineClient, cfg: ServeConfig, model_dir: Optional[str]
                ) -> DrainingServer:
    app = build_app(client, cfg, model_dir)
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level="warning",
                            timeout_graceful_shutdown=cfg.shutdown_grace_s, access_log=False,
                            lifespan="on")
    return DrainingServer(config, client)


def serve_engine(engine, cfg: ServeConfig, model_dir: Optional[str], name: str) -> int:
    """Serve a single-mode ``LLMEngine`` until a signal; 0 when drained."""
    client = EngineClient(engine, name, cfg.max_queued_requests, cfg.retry_after_s)
    server = make_server(client, cfg, model_dir)
    if cfg.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("[serve] serve.host=%s: reachable beyond this machine%s", cfg.host,
                    "" if cfg.api_key else " and serve.api_key is unset")
    try:
        server.run()
    finally:
        client.shutdown()
    return 0


class ModeNotServedError(ConfigError):
    """A deploy mode ``megainfer-serve`` cannot serve yet (only single mode is)."""


def check_servable(deploy_mode: str, world_size: int) -> None:
    if deploy_mode != "single" or world_size != 1:
        raise ModeNotServedError(
            f"deploy.mode={deploy_mode!r} (world size {world_size}): not yet served by "
            "megainfer-serve; only deploy.mode=single (one process) is. The disaggregated "
            "runtime's rank 0 does not host the online engine interface yet (docs/serve.md, "
            "\"Not yet served\"); run the offline job (megainfer-launch) for that mode")
