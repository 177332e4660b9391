"""Run the app under uvicorn: bind (loopback by default), serve until SIGTERM or SIGINT, then
drain: stop listening, no new requests (503), in-flight ones get ``serve.shutdown_grace_s`` to
finish; then the rest are aborted (each open stream ends with ``finish_reason: "abort"`` and
``[DONE]``, each waiting non-streamed request gets a 503), the engine core stops (the runtime:
its closing iteration stops every rank) and the process exits 0. A watchdog stops the server
when the engine core dies (exit 1)."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
from typing import Optional

import uvicorn

from megainfer.config import ServeConfig

from .app import build_app
from .served_engine import ServedEngine
from .http_protocol import header_timeout_protocol

log = logging.getLogger("megainfer.serve")


def served_name(cfg: ServeConfig, model_path: Optional[str], family: str) -> str:
    """``serve.served_model_name``, else the model path as given, else megainfer-<family>."""
    return cfg.served_model_name or model_path or f"megainfer-{family}"


def metrics_label(cfg: ServeConfig, name: str, model_path: Optional[str]) -> str:
    """The metrics' ``model_name``: the served name, but only the last part of a model path
    the operator did not choose to show (``serve.served_model_name`` unset)."""
    if cfg.served_model_name is None and model_path and name == model_path:
        return os.path.basename(os.path.normpath(model_path)) or name
    return name


# once the grace period ran out and the rest was aborted: this long for the aborted
# responses to reach their clients before the connections are cut
FLUSH_S = 5.0


class DrainingServer(uvicorn.Server):
    """uvicorn's server whose first SIGTERM/SIGINT marks the engine client draining (new
    requests get 503) and starts uvicorn's graceful shutdown; unlike uvicorn's own handler it
    does not re-raise the signal afterwards, so a drained server exits 0."""

    def __init__(self, config: uvicorn.Config, client: ServedEngine):
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

    async def shutdown(self, sockets=None) -> None:
        """uvicorn's graceful shutdown, but when the grace period runs out the requests still
        open are aborted through the engine and given ``FLUSH_S`` to end properly (streams:
        an "abort" chunk and [DONE]; non-streamed: 503) before any task is cancelled."""
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        self.client.draining = True
        for connection in list(self.server_state.connections):
            connection.shutdown()
        await asyncio.sleep(0.1)
        if not await self._settle(self.config.timeout_graceful_shutdown):
            n = await self.client.abort_all()
            log.warning("[serve] serve.shutdown_grace_s ran out: %d requests aborted", n)
            if not await self._settle(FLUSH_S):
                for t in self.server_state.tasks:
                    t.cancel(msg="megainfer-serve: shutdown")
        if not self.force_exit:
            await self.lifespan.shutdown()

    async def _settle(self, timeout: Optional[float]) -> bool:
        """Wait up to ``timeout`` for every connection and task to end; whether they did."""
        try:
            await asyncio.wait_for(self._wait_tasks_to_complete(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    def on_signal(self, sig, frame) -> None:
        if self.should_exit:
            self.force_exit = True  # a second signal: stop waiting
            return
        log.info("[serve] %s: draining (grace %.1fs)", signal.Signals(sig).name,
                 self.config.timeout_graceful_shutdown or 0.0)
        self.client.draining = True
        self.should_exit = True


def make_server(client: ServedEngine, cfg: ServeConfig, model_dir: Optional[str]
                ) -> DrainingServer:
    app = build_app(client, cfg, model_dir)
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level="warning",
                            timeout_graceful_shutdown=cfg.shutdown_grace_s, access_log=False,
                            lifespan="on", http=header_timeout_protocol(cfg.header_timeout_s),
                            limit_concurrency=cfg.max_connections)
    return DrainingServer(config, client)


WATCH_INTERVAL_S = 0.2
# a dead core: /health answers 503 (and requests 503 engine_dead) this long before the server
# stops, so a probe or load balancer sees why rather than only a refused connection
DEAD_LINGER_S = 2.0


class CoreWatchdog:
    """Stops the server when the engine core dies (a rank lost, an iteration that raised):
    logs the error once, turns new requests away (503), answers /health 503 for
    ``DEAD_LINGER_S`` and lets uvicorn shut down. In-flight
    requests have already ended with an error event (``AsyncLLM`` hands every waiter the
    core's error). ``error``: what the core died of, None while it lives or after a shutdown
    of ours."""

    def __init__(self, client: ServedEngine, server: DrainingServer):
        self.client, self.server = client, server
        self.error: Optional[BaseException] = None
        self.died = False
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="megainfer-serve-watchdog",
                                       daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(WATCH_INTERVAL_S):
            if self.server.should_exit:
                return  # our own shutdown: the core stops because we stop it
            if not self.client.healthy:
                self.died = True
                self.error = self.client.error
                print(f"[serve] error: engine core died: {self.describe()}; stopping the "
                      "server", file=sys.stderr, flush=True)  # once (stderr: seen under mpiexec)
                self.client.draining = True
                self.stop.wait(DEAD_LINGER_S)
                self.server.should_exit = True
                return

    def describe(self) -> str:
        e = self.error
        return "the engine core stopped" if e is None else f"{type(e).__name__}: {e}"

    def close(self) -> None:
        self.stop.set()
        self.thread.join(1.0)


def serve_client(client: ServedEngine, cfg: ServeConfig, model_dir: Optional[str]) -> int:
    """Serve the engine core behind ``client`` until a signal: 0 when drained; 1 when the core
    died (the watchdog said why)."""
    server = make_server(client, cfg, model_dir)
    if cfg.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("[serve] serve.host=%s: reachable beyond this machine%s", cfg.host,
                    "" if cfg.api_key else " and serve.api_key is unset")
    watchdog = CoreWatchdog(client, server)
    try:
        server.run()
    finally:
        watchdog.close()
        client.shutdown()
    return 1 if watchdog.died else 0
