"""The server's one handle on the engine core: admission (the queue bound, draining), health,
the metrics of each request, and the ``AsyncLLM`` streams. The core is single mode's
``LLMEngine`` or rank 0's ``RuntimeEngine``, in a child job of its own (``ServedEngine.spawn``:
what ``megainfer-serve`` does outside ``mpiexec``) or on a thread beside the frontend
(``ServedEngine.beside``: rank 0 under ``mpiexec``, tests); either way its measurements arrive
with its outputs (``metrics.CoreWatch``). A planner plugs in at one point, ``ServedEngine.planner``
(``TrafficPlanner``; this module imports none): it is told of each request's arrival and
finish, runs beside the server (``app.py``'s lifespan) and orders re-plan switches through
``order_replan``. docs/serve.md."""
from __future__ import annotations

import asyncio
import itertools
import time
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, Awaitable, Callable, Optional, Protocol

from megainfer.async_llm import AsyncLLM
from megainfer.config import ServeConfig
from megainfer.engine import RequestError, RequestOutput, SamplingParams
from megainfer.engine.stats import core_hangs
from megainfer.engine.failures import EngineDeadError
from megainfer.engine.grammar import Grammars

from .errors import APIError, request_error
from .metrics import CoreWatch, RequestTimer, ServedRequest, ServeMetrics

MIN_ITERATION_ALLOWANCE_S = 1.0  # health: the least time one iteration may take
OFF_LOOP_CHARS = 4096  # a text prompt longer than this is tokenised off the event loop
QUEUED_TOKENS_PER_MAX_LEN = 16  # serve.max_queued_tokens=null: this many max_model_len,
MIN_QUEUED_TOKENS = 1 << 18  # and at least this many (256 prompts of 1024 tokens)


class TrafficPlanner(Protocol):
    """What the server feeds a planner (``replan.policy=planner``: ``serve/planner_loop.py``),
    on the event loop."""

    def arrived(self, prompt_len: int) -> None: ...

    def finished(self, req: ServedRequest) -> None: ...

    def run(self, client: "ServedEngine") -> Awaitable[None]: ...  # until cancelled

    def view(self) -> dict: ...  # GET /planner


class ServedEngine:
    planner: Optional[TrafficPlanner] = None  # the live planner, when one runs

    def __init__(self, make_llm, model_name: str, cfg: ServeConfig = ServeConfig(),
                 role: str = "single", hang_after_s: Optional[float] = None,
                 metrics_label: Optional[str] = None):
        """``make_llm``: on_stats -> the ``AsyncLLM`` to serve; ``cfg``: the queue bounds and
        ``Retry-After``; ``role``: the iteration-time label (``metrics.iteration_role``);
        ``hang_after_s``: a core on a thread here that stays inside one iteration longer is
        declared hung (``OnlineEngine.hang_after_s``; None: not watched); ``metrics_label``:
        the metrics' ``model_name`` (None: ``model_name``)."""
        self.hang_after_s = hang_after_s
        self.model_name = model_name
        self.metrics = ServeMetrics(metrics_label or model_name)
        self.watch = CoreWatch(self.metrics, role)
        self.llm: AsyncLLM = make_llm(self.watch.apply)
        intake = self.llm.intake
        self.tokenizer = self.llm.tokenizer
        self.max_model_len = intake.max_model_len
        self.max_queued, self.retry_after = cfg.max_queued_requests, cfg.retry_after_s
        self.max_queued_tokens = cfg.max_queued_tokens or max(
            QUEUED_TOKENS_PER_MAX_LEN * self.max_model_len, MIN_QUEUED_TOKENS)
        self.seqs_in_flight = 0  # sequences of the admitted requests not yet released
        self.tokens_queued = 0  # prompt tokens of admitted prompts not yet prefilled
        self.live: set[str] = set()  # the engine request ids of admitted requests
        self.cut: set[str] = set()  # of those, the ones the drain aborted
        self.tokenize_pool = ThreadPoolExecutor(2, thread_name_prefix="megainfer-tokenize")
        self.draining = False
        self._ids = itertools.count()

    @classmethod
    def beside(cls, engine, model_name: str, cfg: ServeConfig = ServeConfig(),
               role: str = "single", hang_after_s: Optional[float] = None,
               metrics_label: Optional[str] = None) -> "ServedEngine":
        """Serve an online engine built in this process (``LLM(...).engine``, rank 0's
        ``RuntimeEngine``) with its core on a thread here."""
        return cls(lambda on_stats: AsyncLLM.from_engine(engine, on_stats), model_name, cfg,
                   role, hang_after_s, metrics_label)

    @classmethod
    def spawn(cls, spec, job, model_name: str, cfg: ServeConfig = ServeConfig(),
              role: str = "single", metrics_label: Optional[str] = None) -> "ServedEngine":
        """Start the job's ranks (single mode: one) as a child job whose rank 0 runs the core
        (``core_client.spawn``); ``job``: rank 0's resolution of ``spec``."""
        return cls(lambda on_stats: AsyncLLM.from_job(spec, job, engine_process=True,
                                                      on_stats=on_stats),
                   model_name, cfg, role, None, metrics_label)

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
        return self.llm.intake.vocab_size  # an Intake, or the engine itself

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

    def check_size(self, seqs: int, tokens: int = 0) -> None:
        """A 400 for a request of more sequences (prompts x n) or prompt tokens than the queue
        bounds could ever hold (no retry can pass it); cheap, so it comes before tokenising."""
        for what, cost, bound, key in (("sequences (prompts x n)", seqs, self.max_queued,
                                        "max_queued_requests"),
                                       ("prompt tokens", tokens, self.max_queued_tokens,
                                        "max_queued_tokens")):
            if cost > bound:
                raise APIError(f"request of {cost} {what}: more than the server queues "
                               f"(serve.{key}={bound})", 400, code="request_too_large")

    def admit(self, seqs: int, tokens: int, request_ids: list[str]) -> "Admission":
        """Hold the places of a request of ``seqs`` sequences (prompts x n) and ``tokens``
        prompt tokens, under ``request_ids``, until ``release``. A request the bounds could
        never hold: 400; the queue full, the server draining or the engine dead: 503 with
        Retry-After; an id already in use: 400 naming request_id."""
        self.check_size(seqs, tokens)
        headers = {"Retry-After": str(self.retry_after)}
        if self.draining:
            raise APIError("server is shutting down", 503, code="shutting_down", headers=headers)
        if not self.healthy:
            raise APIError("engine is not running", 503, code="engine_dead", headers=headers)
        queued = self.seqs_in_flight - self.num_running()
        if queued + seqs > self.max_queued:
            raise APIError(f"queue full: {queued} sequences waiting (serve.max_queued_requests="
                           f"{self.max_queued})", 503, code="queue_full", headers=headers)
        if self.tokens_queued + tokens > self.max_queued_tokens:
            raise APIError(f"queue full: {self.tokens_queued} prompt tokens waiting "
                           f"(serve.max_queued_tokens={self.max_queued_tokens})", 503,
                           code="queue_full", headers=headers)
        taken = next((r for r in request_ids if r in self.live), None)
        if taken is not None:
            raise APIError(f"request_id={taken!r}: already queued or running", 400,
                           "request_id")
        self.seqs_in_flight += seqs
        self.tokens_queued += tokens
        self.live.update(request_ids)
        return Admission(self, seqs, tokens, request_ids)

    async def off_loop(self, chars: int, fn, *args):
        """``fn(*args)``: on a worker thread when it works on more than ``OFF_LOOP_CHARS``
        characters of text (tokenising, rendering a template), never then on the event loop."""
        if chars > OFF_LOOP_CHARS:
            return await asyncio.get_running_loop().run_in_executor(self.tokenize_pool, fn,
                                                                    *args)
        return fn(*args)

    async def prompt_ids(self, prompt, params: SamplingParams, prompt_field: str = "prompt"
                         ) -> list[int]:
        """The prompt's token ids, validated as the engine will (a 400 naming the field); a
        long text is tokenised off the event loop."""
        chars = len(prompt) if isinstance(prompt, str) else 0
        return await self.off_loop(chars, self.check_prompt, prompt, params, prompt_field)

    async def compile_grammar(self, params: SamplingParams, field: str) -> None:
        """The request's grammar compiled (or found in the cache) on a worker thread, never on
        the event loop; one that does not compile: a 400 naming ``field``."""
        spec = params.structured_outputs
        if spec is None:
            return
        intake = self.llm.intake
        grammars = Grammars(intake.tokenizer, intake.vocab_size)
        try:
            await asyncio.get_running_loop().run_in_executor(self.tokenize_pool, grammars.get,
                                                             spec)
        except RequestError as e:
            raise APIError(str(e), 400, field) from e

    def check_params(self) -> SamplingParams:
        """Parameters that let a prompt alone be checked (``/tokenize``)."""
        return SamplingParams(max_tokens=self.max_model_len)

    def check_prompt(self, prompt, params: SamplingParams, prompt_field: str = "prompt"
                     ) -> list[int]:
        try:
            return self.llm.intake.tokenize(prompt, params).prompt_token_ids
        except RequestError as e:
            raise request_error(e, prompt_field) from e

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

    async def generate(self, ids: list[int], params: SamplingParams, request_id: str,
                       admission: Optional["Admission"] = None
                       ) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs, metrics observed; leaving early aborts the request. The first
        output gives the prompt's tokens back to ``admission`` (prefilled: no longer queued)."""
        m = self.metrics
        m.labels(m.prompt_tokens).inc(len(ids))
        timer = RequestTimer(m)
        if self.planner is not None:
            self.planner.arrived(len(ids))
        started = admission is None
        async for out in self.llm.generate({"prompt_token_ids": ids}, params, request_id):
            if not started:
                started = True
                admission.prefilled(len(ids))
            timer.tokens(sum(len(c.token_ids) for c in out.outputs))
            if out.finished:
                timer.finished(out)
                if self.planner is not None:
                    self.planner.finished(timer.served(out))
            yield out

    def order_replan(self, label: str, reason: str) -> None:
        """A planner's switch of every rank to ``label`` (``aNeMmK``), carried out by the
        engine core at its next iteration."""
        self.llm.order_replan(label, reason)

    async def abort_all(self) -> int:
        """The drain's end: abort every request still live (their streams end with
        ``finish_reason="abort"``; ``cut`` remembers them, so a non-streamed one is a 503)."""
        ids = list(self.live)
        self.cut.update(ids)
        for rid in ids:
            await self.llm.abort(rid)
        return len(ids)

    def shutdown(self) -> None:
        self.llm.shutdown()
        self.tokenize_pool.shutdown(wait=False, cancel_futures=True)


class Admission:
    """Places held in the server's queue bounds (sequences, prompt tokens not yet prefilled)
    and request ids; ``release`` (idempotent) gives them back."""

    def __init__(self, client: ServedEngine, seqs: int, tokens: int, request_ids: list[str]):
        self.client, self.seqs, self.tokens, self.request_ids = client, seqs, tokens, request_ids

    def prefilled(self, tokens: int) -> None:
        """One prompt of the request started: its tokens are no longer queued."""
        tokens = min(tokens, self.tokens)
        self.client.tokens_queued -= tokens
        self.tokens -= tokens

    def release(self) -> None:
        c = self.client
        if self.seqs or self.tokens:
            c.seqs_in_flight -= self.seqs
            c.tokens_queued -= self.tokens
            self.seqs = self.tokens = 0
        if self.request_ids:
            c.live.difference_update(self.request_ids)
            c.cut.difference_update(self.request_ids)
            self.request_ids = []
