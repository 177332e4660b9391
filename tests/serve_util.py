"""Servers for the serve tests, on 127.0.0.1: ``ThreadServer``, a megainfer-serve app on an
ephemeral port in a background thread of the test process (uvicorn's own server; the engine
core is the AsyncLLM's thread), and ``MpiServe``, the installed ``megainfer-serve`` under a
real ``mpiexec -n K`` (its own process group, killed at ``close``); ``gauge`` reads one series
of ``/metrics``."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid

import httpx

from megainfer import LLM
from mpi_util import mpiexec_path
from megainfer.config import ServeConfig
from megainfer.engine_core.messages import parse_roster
from megainfer.serve.served_engine import ServedEngine
from megainfer.serve.server import make_server

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
BIN = os.path.dirname(sys.executable)
HYDRA_QUIET = ["hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=none",
               "hydra/hydra_logging=none"]


class ThreadServer:
    def __init__(self, ckpt: str, name: str = "tiny", llm_kw: dict = None, **serve_kw):
        self.llm = LLM(ckpt, **(llm_kw or {}))
        self.cfg = ServeConfig(port=0, served_model_name=name, **serve_kw)
        self.client = ServedEngine.beside(self.llm.engine, name, self.cfg)
        self.server = make_server(self.client, self.cfg, ckpt)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            if time.monotonic() - t0 > 30 or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.client.shutdown()


def post_json(url: str, body, headers: dict, path: str = "/v1/completions", client=httpx,
              **kw) -> httpx.Response:
    """POST ``body`` to ``url + path``: a dict as JSON, raw text or bytes as they are (a
    malformed body), with ``Content-Type: application/json`` either way."""
    kw.setdefault("timeout", 30)
    if isinstance(body, (bytes, str)):
        return client.post(url + path, content=body,
                           headers={**headers, "content-type": "application/json"}, **kw)
    return client.post(url + path, json=body, headers=headers, **kw)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gauge(url: str, name: str) -> float:
    """One series of ``/metrics`` (0 while a labelled counter has no sample yet)."""
    m = httpx.get(url + "/metrics").text
    hit = re.search(rf"^megainfer:{name}\{{[^}}]*\}} (\S+)$", m, re.M)
    return float(hit.group(1)) if hit else 0.0


def wait_for(cond, timeout: float = 10.0, what: str = "condition") -> None:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, f"{what}: not within {timeout}s"
        time.sleep(0.05)


def _running(pid: int) -> bool:
    """``pid`` is a live process (not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


class MpiServe:
    """``mpiexec -n ranks megainfer-serve OVERRIDES`` until it prints its address (``ranks``
    None: a plain ``megainfer-serve`` process, the frontend, starting its engine core's child
    job); ``pids``: rank -> pid (from its ``[serve] ranks:`` line); ``lines``: what it printed
    so far."""

    def __init__(self, ranks, overrides: list[str], start_timeout: float = 240.0):
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.tag = f"serve-test-{uuid.uuid4().hex[:12]}"  # on every rank's command line
        cmd = [os.path.join(BIN, "megainfer-serve"), f"serve.port={port}", *overrides,
               *HYDRA_QUIET, f"hydra.job.name={self.tag}"]
        if ranks is not None:
            cmd = [mpiexec_path(), "-n", str(ranks), *cmd]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env, start_new_session=True)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        try:
            wait_for(lambda: self.proc.poll() is not None or any(" on http://" in x
                                                                 for x in self.lines),
                     start_timeout, "server start")
            assert self.proc.poll() is None, f"server exited:\n{self.output()}"
        except BaseException:
            self.close()
            raise
        ranks_line = next((x for x in self.lines if x.startswith("[serve] ranks: ")), "")
        self.pids = {r: info.pid for r, info in parse_roster(ranks_line).items()}

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def output(self) -> str:
        return "\n".join(self.lines[-80:])

    def signal(self, sig) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        rc = self.proc.wait(timeout)
        self.reader.join(5)
        return rc

    def alive_pids(self) -> list[int]:
        """The job's processes still there: mpiexec and every rank (``pgrep -f`` of the tag on
        their command lines; the ranks run in a session of their own), and every rank of its
        ``[serve] ranks:`` line (a plain frontend's child job does not carry the tag)."""
        out = subprocess.run(["pgrep", "-f", self.tag], capture_output=True, text=True).stdout
        ranks = [p for p in getattr(self, "pids", {}).values() if _running(p)]
        return sorted(set(int(x) for x in out.split()) | set(ranks))

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        for pid in self.pids.values() if hasattr(self, "pids") else ():
            try:
                os.kill(pid, signal.SIGCONT)  # a rank a test stopped goes with its group
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
