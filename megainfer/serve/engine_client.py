"""The server's one handle on the engine core: admission (the queue bound, draining), health,
the metrics of each request, and the ``AsyncLLM`` streams. The core is single mode's
``LLMEngine`` or rank 0's ``RuntimeEngine``, in a child job of its own (``EngineClient.spawn``:
what ``megainfer-serve`` does outside ``mpiexec``) or on a thread beside the frontend
(``EngineClient.beside``: rank 0 under ``mpiexec``, tests); either way its measurements arrive
with its outputs (``metrics.CoreWatch``). docs/serve.md."""
from __future__ import annotations

import itertools
import time
from typing import AsyncIterator, Optional

from megainfer.async_llm import AsyncLLM
from megainfer.engine import RequestError, RequestOutput, SamplingParams
from megainfer.core_client.core_stats import core_hangs
from megainfer.engine.errors import EngineDeadError

from .errors import APIError, request_error
from .metrics import CoreWatch, RequestTimer, ServeMetrics

MIN_ITERATION_ALLOWANCE_S = 1.0  # health: the least time one iteration may take


class EngineClient:
    def __init__(self, make_llm, model_name: str, max_queued_requests: int = 256,
                 retry_after_s: int = 1, role: str = "single",
                 hang_after_s: Optional[float] = None):
        """``make_llm``: on_stats -> the ``AsyncLLM`` to serve; ``role``: the iteration-time
        label (``metrics.iteration_role``); ``hang_after_s``: a core on a thread here that
        stays inside one iteration longer is declared hung (``core_stats.hang_after_s``; None:
        not watched)."""
        self.hang_after_s = hang_after_s
        self.model_name = model_name
        self.metrics = ServeMetrics(model_name)
        self.watch = CoreWatch(self.metrics, role)
        self.llm: AsyncLLM = make_llm(self.watch.apply)
        intake = self.llm.intake
        self.tokenizer = self.llm.tokenizer
        self.max_model_len = intake.max_model_len
        self.max_queued, self.retry_after = max_queued_requests, retry_after_s
        self.in_flight = 0
        self.draining = False
        self._ids = itertools.count()

    @classmethod
    def beside(cls, engine, model_name: str, max_queued_requests: int = 256,
               retry_after_s: int = 1, role: str = "single",
               hang_after_s: Optional[float] = None) -> "EngineClient":
        """Serve an online engine built in this process (``LLM(...).engine``, rank 0's
        ``RuntimeEngine``) with its core on a thread here."""
        return cls(lambda on_stats: AsyncLLM.from_engine(engine, on_stats), model_name,
                   max_queued_requests, retry_after_s, role, hang_after_s)

    @classmethod
    def spawn(cls, spec, job, model_name: str, max_queued_requests: int = 256,
              retry_after_s: int = 1, role: str = "single") -> "EngineClient":
        """Start the job's ranks (single mode: one) as a child job whose rank 0 runs the core
        (``core_client.spawn``); ``job``: rank 0's resolution of ``spec``."""
        return cls(lambda on_stats: AsyncLLM.from_job(spec, job, engine_process=True,
                                                      on_stats=on_stats),
                   model_name, max_queued_requests, retry_after_s, role)

    @property
    def healthy(self) -> bool:
        """The engine core runs (it has not died or shut down). A core on a thread here found
        inside one iteration past ``hang_after_s`` is declared dead first (its requests end
        with the error; the watchdog then stops the server)."""
        if self.hang_after_s is not None and self.llm.is_running:
            hangs = core_hangs(self.llm.core_busy_s(), self.hang_after_s)
            if hangs is not None:
                self.llm.fail(EngineDeadError(f"[serve] {hangs}"))
        return self.llm.is_running

    @property
    def vocab_size(self) -> int:
        intake = self.llm.intake  # an Intake, or the engine itself (LLMEngine, RuntimeEngine)
        return getattr(intake, "vocab_size", None) or intake.model_config.vocab_size

    @property
    def error(self) -> Optional[BaseException]:
        """What the engine core died of (None while it runs, or after our shutdown)."""
        return self.llm.error

    def stale_after_s(self) -> Optional[float]:
        """The runtime: how long since its last iteration means a rank stopped answering (two
        idle intervals plus twice the slowest recent iteration, at least
        ``MIN_ITERATION_ALLOWANCE_S``, plus what a re-plan's switch may take when the runtime
        re-plans); None for single mode (one process: alive is enough)."""
        idle = self.watch.idle_interval_s
        if idle is None:
            return None
        return 2 * idle + max(MIN_ITERATION_ALLOWANCE_S, 2 * self.watch.slowest_recent_s()) \
            + self.watch.stall_allowance_s

    def answering(self) -> bool:
        """Every rank answers: the core runs and (the runtime) its iterations keep coming."""
        if not self.healthy:
            return False
        bound = self.stale_after_s()
        return bound is None or time.monotonic() - self.watch.last_iteration_at <= bound

    def new_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}"

    def num_running(self) -> int:
        return self.watch.load.running

    def admit(self, count: int = 1) -> "Admission":
        """Hold ``count`` requests' places until ``release``; 503 with Retry-After when the
        queue is full or the server drains."""
        headers = {"Retry-After": str(self.retry_after)}
        if self.draining:
            raise APIError("server is shutting down", 503, code="shutting_down", headers=headers)
        if not self.healthy:
            raise APIError("engine is not running", 503, code="engine_dead", headers=headers)
        queued = self.in_flight - self.num_running()
        if queued + count > self.max_queued:
            raise APIError(f"queue full: {queued} requests waiting (serve.max_queued_requests="
                           f"{self.max_queued})", 503, code="queue_full", headers=headers)
        self.in_flight += count
        return Admission(self, count)

    def check_prompt(self, prompt, params: SamplingParams, prompt_field: str = "prompt"
                     ) -> list[int]:
        """The prompt's token ids, validated as the engine will (a 400 naming the field)."""
        try:
            ids = self.llm.intake.tokenize(prompt, params).prompt_token_ids
        except RequestError as e:
            raise request_error(e, prompt_field) from e
        return ids

    def token_budget(self, ids: list[int], asked: Optional[int], field: str) -> int:
        """``max_tokens``: the asked number (400 when the prompt leaves no room for it), or all
        that max_model_len leaves."""
        room = self.max_model_len - len(ids)
        if asked is None:
            if room < 1:
                raise APIError(f"prompt length={len(ids)} tokens: leaves no room to generate "
                               f"within max_model_len={self.max_model_len}", 400, "prompt")
            return room
        if not isinstance(asked, int) or asked < 1:
            raise APIError(f"{field}={asked!r}: must be an integer >= 1", 400, field)
        if asked > room:
            raise APIError(f"{field}={asked} with a prompt of {len(ids)} tokens: exceeds "
                           f"max_model_len={self.max_model_len}", 400, field)
        return asked

    async def generate(self, ids: list[int], params: SamplingParams, request_id: str
                       ) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs, metrics observed; leaving early aborts the request."""
        m = self.metrics
        m.labels(m.prompt_tokens).inc(len(ids))
        timer = RequestTimer(m)
        async for out in self.llm.generate({"prompt_token_ids": ids}, params, request_id):
            timer.tokens(sum(len(c.token_ids) for c in out.outputs))
            if out.finished:
                timer.finished(out)
            yield out

    def shutdown(self) -> None:
        self.llm.shutdown()


class Admission:
    """Places held in the server's queue bound; ``release`` (idempotent) gives them back."""

    def __init__(self, client: EngineClient, count: int):
        self.client, self.count = client, count

    def release(self) -> None:
        if self.count:
            self.client.in_flight -= self.count
            self.count = 0
