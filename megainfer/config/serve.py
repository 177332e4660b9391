"""The HTTP server's section of the config tree (``serve.*``, docs/serve.md)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .base import is_int_at_least, is_number, require


REASONING_PARSERS = ("deepseek_r1", "qwen3")  # megainfer/serve/reasoning.py
TOOL_CALL_PARSERS = ("hermes", "deepseek_v3")  # megainfer/serve/tool_parsers.py


def _opt_text(v) -> bool:
    return v is None or (isinstance(v, str) and bool(v.strip()))


@dataclass(frozen=True)
class ServeConfig:
    """``megainfer-serve``'s own settings; the model, scheduler and cache come from the
    launcher's groups. Requests never name files: ``chat_template`` is the operator's."""

    # bind address; loopback by default (0.0.0.0 exposes the server)
    host: str = "127.0.0.1"
    # TCP port (0: an ephemeral one, printed at start)
    port: int = 8000
    # the model id clients send; null: model.path as given (dummy weights: megainfer-<family>)
    served_model_name: Optional[str] = None
    # set: /v1/*, /tokenize and /detokenize need "Authorization: Bearer <key>" (401 otherwise)
    api_key: Optional[str] = None
    # sequences (prompts x n) admitted but not yet running; one more gets 503 with Retry-After,
    # a request of more sequences than this on its own a 400
    max_queued_requests: int = 256
    # prompt tokens admitted but not yet prefilled (null: 16 x max_model_len, at least 262144);
    # beyond it 503, a request of more prompt tokens on its own a 400
    max_queued_tokens: Optional[int] = None
    # the most samples (n, best_of) one request may ask for (400 naming the field beyond it)
    max_n: int = 128
    # the largest request body in bytes (413 beyond it, refused before it is read)
    max_body_bytes: int = 8 * 1024 * 1024
    # a client gets this long to send a request's headers (then the connection is closed)
    header_timeout_s: float = 10.0
    # the longest wait between two parts of a request body (then 408)
    body_timeout_s: float = 30.0
    # open connections at most (uvicorn's limit_concurrency: 503 beyond it)
    max_connections: int = 1024
    # with api_key set: /metrics needs the key too
    metrics_require_key: bool = True
    # SIGTERM/SIGINT: in-flight requests get this long to finish, then are aborted
    shutdown_grace_s: float = 30.0
    # a Jinja chat template (text, or a file the operator names) instead of the checkpoint's
    chat_template: Optional[str] = None
    # the Retry-After header (seconds) of a 503 (queue full, draining)
    retry_after_s: int = 1
    # outside mpiexec: the engine core in a child job of its own (single mode too), the HTTP
    # frontend in this process; false: single mode's core on a thread of this process
    engine_process: bool = True
    # outside mpiexec: the ranks to start (null: what the deploy plan's counts need, 1 for
    # single mode); under mpiexec the launch's size (this must then be null or equal to it)
    world_size: Optional[int] = None
    # the reasoning model's format (deepseek_r1 | qwen3): chat answers carry its <think> block
    # as message.reasoning_content (streamed: delta.reasoning_content), content the rest;
    # null: the text as it comes
    reasoning_parser: Optional[str] = None
    # tool_choice "auto" (the default when a request gives tools) reads calls from the model's
    # text with tool_call_parser; false: tools need tool_choice "required" or a named function
    enable_auto_tool_choice: bool = False
    # the model's tool-call format for "auto" (hermes: Qwen's <tool_call>{...}</tool_call>;
    # deepseek_v3: DeepSeek-V3's tool-call tokens); null: none
    tool_call_parser: Optional[str] = None

    def __post_init__(self):
        require(isinstance(self.host, str) and bool(self.host), "serve.host", self.host,
                 "must be a host name or address")
        require(is_int_at_least(self.port, 0) and self.port <= 65535, "serve.port", self.port,
                "must be in [0, 65535]")
        for k in ("served_model_name", "api_key", "chat_template"):
            require(_opt_text(getattr(self, k)), f"serve.{k}", getattr(self, k),
                     "must be a non-empty string or null")
        for k in ("max_queued_requests", "max_n", "max_body_bytes", "max_connections",
                  "retry_after_s"):
            require(is_int_at_least(getattr(self, k), 1), f"serve.{k}", getattr(self, k),
                    "must be an integer >= 1")
        require(self.max_queued_tokens is None or is_int_at_least(self.max_queued_tokens, 1),
                "serve.max_queued_tokens", self.max_queued_tokens,
                "must be an integer >= 1 or null")
        require(is_number(self.shutdown_grace_s, finite=False) and self.shutdown_grace_s >= 0,
                "serve.shutdown_grace_s", self.shutdown_grace_s, "must be a number >= 0")
        for k in ("header_timeout_s", "body_timeout_s"):
            require(is_number(getattr(self, k)) and getattr(self, k) > 0, f"serve.{k}",
                    getattr(self, k), "must be a number > 0")
        require(isinstance(self.metrics_require_key, bool), "serve.metrics_require_key",
                self.metrics_require_key, "must be true or false")
        require(isinstance(self.engine_process, bool), "serve.engine_process",
                 self.engine_process, "must be true or false")
        require(self.world_size is None or is_int_at_least(self.world_size, 1),
                "serve.world_size", self.world_size, "must be an integer >= 1 or null")
        require(self.reasoning_parser in (None,) + REASONING_PARSERS, "serve.reasoning_parser",
                self.reasoning_parser, f"must be one of {', '.join(REASONING_PARSERS)} or null")
        require(self.tool_call_parser in (None,) + TOOL_CALL_PARSERS, "serve.tool_call_parser",
                self.tool_call_parser, f"must be one of {', '.join(TOOL_CALL_PARSERS)} or null")
        require(isinstance(self.enable_auto_tool_choice, bool), "serve.enable_auto_tool_choice",
                self.enable_auto_tool_choice, "must be true or false")
        require(not self.enable_auto_tool_choice or self.tool_call_parser is not None,
                "serve.enable_auto_tool_choice", self.enable_auto_tool_choice,
                "needs serve.tool_call_parser")
