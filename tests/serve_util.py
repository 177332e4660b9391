"""A megainfer-serve app on 127.0.0.1 and an ephemeral port, in a background thread of the test
process (uvicorn's own server; the engine core is the AsyncLLM's thread)."""
from __future__ import annotations

import threading
import time

from megainfer import LLM
from megainfer.config import ServeConfig
from megainfer.serve.engine_client import EngineClient
from megainfer.serve.server import make_server

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


class ThreadServer:
    def __init__(self, ckpt: str, name: str = "tiny", llm_kw: dict = None, **serve_kw):
        self.llm = LLM(ckpt, **(llm_kw or {}))
        self.cfg = ServeConfig(port=0, served_model_name=name, **serve_kw)
        self.client = EngineClient(self.llm.engine, name, self.cfg.max_queued_requests,
                                   self.cfg.retry_after_s)
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
