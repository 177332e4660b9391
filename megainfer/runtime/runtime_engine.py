"""Rank 0 of the distributed runtime as an online engine (``engine_core.core.OnlineEngine``): the
engine core behind ``LLM(deploy=...)``, ``AsyncLLM`` and the server in every mode but single.

Requests arrive between iterations (``add_tokenized``) and are handed out at the next one;
each ``step_outputs`` is one iteration of every rank and returns every replica's new tokens and
finished outputs; ``abort_request`` ends a request wherever it is. With nothing to do the core
waits up to ``idle_interval_s``, then runs one empty iteration (``idle_tick``) so every rank's
watch on the others stays alive; ``close`` runs the iteration that stops every rank. A feature
plugs in at one point, ``Feature.online(rank) -> OnlinePlug`` (this module imports none): its
``between`` may end the loop's phase and hands back the loop to go on with, ``switching`` is
true while it works. docs/engine.md, "Online: `AsyncLLM` and the engine core" (Rank 0).
"""
from __future__ import annotations

import logging
import time
from typing import Optional, Protocol

from megainfer.engine.errors import DuplicateRequestError
from megainfer.engine.intake import TokenizedPrompt
from megainfer.engine.outputs import PromptInput, RequestOutput, StepOutputs
from megainfer.engine.sampling_params import SamplingParams
from megainfer.engine.stats import EngineLoad
from megainfer.runtime.control import silent_peer
from megainfer.runtime.roles import assign_role
from megainfer.runtime import timeouts
from megainfer.runtime.span_report import PipelineSpans

log = logging.getLogger("megainfer.runtime")


class OnlinePlug(Protocol):
    switching: bool  # its work between two iterations runs now (another thread may read it)

    def between(self, loop): ...  # after an iteration: the loop to go on with

    def drain(self) -> None: ...  # the engine core shuts down: only its last iterations follow

    def order(self, label: str, reason: str) -> None: ...  # a switch from outside the loop

    def close(self) -> None: ...  # after the last iteration (the ranks told to stop)


class RuntimeEngine:
    def __init__(self, rank):
        self.rank, self.loop = rank, rank.loop
        self.engine = rank.loop.engine  # rank 0's own replica: tokenizer and limits
        self.requests: dict[str, SamplingParams] = {}  # the open requests (the core's view)
        self.detokenize = False
        self.log_prefix = rank.role.label
        self.idle_interval_s = timeouts.idle_interval_s(rank.job.comm.timeout_s)
        self.failed: Optional[BaseException] = None
        self.closed = False
        self.num_iterations = 0
        self.last_iteration_at = time.monotonic()  # every rank answered then
        feature = rank.feature
        self.plug: Optional[OnlinePlug] = (feature.online(rank) if feature is not None
                                           and feature.online is not None else None)
        self.stall_allowance_s = 0.0 if self.plug is None else \
            timeouts.switch_wait_s(rank.job.comm.timeout_s)  # a switch runs inside an iteration
        tracer = rank.tracer  # T_a / T_e / T_c: traced on cpu only (a cuda span's time is known
        self.spans = PipelineSpans(rank) if tracer.enabled and not tracer.cuda else None  # late)
        self.arrived: dict[str, float] = {}  # requests not handed out yet: their arrival here
        self.held: dict[str, float] = {}  # handed out, not finished: how long rank 0 held them
        self.loop.open_online()

    @property
    def switching(self) -> bool:
        """A plug's work between iterations runs (a re-plan's switch): no iteration comes until
        it ends, and no rank is lost for that (``last_iteration_at`` is set when it ends)."""
        return self.plug is not None and self.plug.switching

    @property
    def replans(self) -> list:
        """The re-plans so far, one record each (``Rank.replans``; empty without re-planning)."""
        return list(self.rank.replans)

    @property
    def stream_tokens(self) -> bool:
        return self.loop.stream

    @stream_tokens.setter
    def stream_tokens(self, on: bool) -> None:
        """True: every replica reports each step's new tokens (a streaming core); False: only
        the finished outputs cross to rank 0 (``LLM``, the offline job). Set before the first
        iteration, whose first share tells the replicas."""
        self.loop.stream = on

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def model_config(self):
        return self.engine.model_config

    @property
    def vocab_size(self) -> int:
        return self.engine.model_config.vocab_size

    def load(self) -> EngineLoad:
        """The replicas' queues as the last iteration's reports gave them (safe to read from
        another thread: a list replaced whole each iteration)."""
        sts = self.loop.statuses
        return EngineLoad(sum(s.running for s in sts), sum(s.waiting for s in sts),
                          sum(s.kv_usage for s in sts) / max(1, len(sts)),
                          self.loop.pending_count())

    def held_s(self, request_id) -> float:
        """How long rank 0 held a finished request before handing it out (its replica's
        queue time follows)."""
        return self.held.pop(str(request_id), 0.0)

    def take_spans(self):
        return None if self.spans is None else self.spans.take()

    def replan_switches(self) -> list[tuple[str, float]]:
        """(who ordered it: forced | measured | planner, seconds) of every re-plan so far."""
        return [(rec["kind"], rec["seconds"]) for rec in self.rank.replans]

    def order_replan(self, label: str, reason: str) -> None:
        """A live planner's switch to ``label`` (``aNeMmK``), carried out at the next
        iteration, idle or not (``replan.policy=planner``; the plug's ``order``)."""
        if self.plug is None:
            raise RuntimeError(f"re-plan order {label!r}: this job does not re-plan "
                               "(replan.enabled=false)")
        self.plug.order(label, reason)

    def offload_report(self):
        """PD with ``pd.offload``: the decode replicas' offload (``messages.OffloadStatus``, its
        round trips since the last call), else None."""
        return self.loop.offload_report()

    def hang_after_s(self, timeout_s: float) -> float:
        return timeouts.core_hang_s(timeout_s) + self.stall_allowance_s

    # ------------------------------------------------------------------ OnlineEngine
    def tokenize(self, prompt, params: SamplingParams, prompt_token_ids=None) -> TokenizedPrompt:
        return self.engine.tokenize(prompt, params, prompt_token_ids)

    def add_tokenized(self, request_id, prompt: TokenizedPrompt, params: SamplingParams):
        """Queued for the next iteration's hand-out; the replica that gets it validates what
        only an engine can (a refusal comes back as its final output, finish_reason "error")."""
        rid = str(request_id)
        if rid in self.requests:
            raise DuplicateRequestError(f"request_id={rid!r}: already queued or running")
        self.requests[rid] = params
        self.arrived[rid] = time.perf_counter()
        self.loop.submit([PromptInput(rid, None, list(prompt.prompt_token_ids), params)])

    def abort_request(self, request_id) -> Optional[RequestOutput]:
        rid = str(request_id)
        if rid not in self.requests:
            return None
        out = self.loop.abort(rid)
        if out is not None:
            del self.requests[rid]
            self.arrived.pop(rid, None)
            self.held.pop(rid, None)
        return out

    def step_outputs(self) -> StepOutputs:
        t0 = time.perf_counter()
        try:
            done = self.loop.iterate()
            self._handed_out(t0)
            new_tokens = list(self.loop.new_tokens)
            if self.plug is not None:
                self.loop = self.plug.between(self.loop)
        except BaseException as e:
            self.failed = e
            raise self._named(e) from e
        self.num_iterations += 1
        self.last_iteration_at = time.monotonic()
        finished = []
        for out in done:
            if self.requests.pop(str(out.request_id), None) is not None:
                finished.append(out)  # (an output of a request aborted here already: dropped)
            self.arrived.pop(str(out.request_id), None)  # (refused before any hand-out)
        return StepOutputs(new_tokens, finished)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def _handed_out(self, t0: float) -> None:
        """The requests this iteration (begun at ``t0``) handed out: how long rank 0 held them."""
        if not self.arrived:
            return
        pending = self.loop.pending_ids()
        for rid in [r for r in self.arrived if r not in pending]:
            self.held[rid] = max(0.0, t0 - self.arrived.pop(rid))

    def _named(self, e: BaseException) -> BaseException:
        """A peer that did not answer -> ``RankLostError`` naming its rank and role
        (``control.silent_peer``); anything else as it is."""
        return silent_peer(e, self._role_of) or e

    def _role_of(self, peer: int) -> Optional[str]:
        deploy = self.rank.job.deploy
        return assign_role(deploy, peer, deploy.world_size).label \
            if 0 <= peer < deploy.world_size else None

    def idle_tick(self) -> None:
        self.step_outputs()

    def drain(self) -> None:
        """The engine core's shutdown began (``EngineCore``): the plug's work between
        iterations stops (no re-plan switch while the last iterations end the requests)."""
        if self.plug is not None:
            self.plug.drain()

    def close(self) -> None:
        """Stop every rank (one last iteration) and close this rank's connections. After a
        failure only this rank's own resources: the others notice within their timeouts."""
        if self.closed:
            return
        self.closed = True
        try:
            if self.failed is None:
                self.loop.close()
                if self.plug is not None:
                    self.plug.close()
                if self.spans is not None:
                    self.spans.close()  # every span report received: none left at finalize
        finally:
            self.rank.close()
            log.info("%s runtime closed after %d iterations", self.log_prefix,
                     self.num_iterations)
