"""Continuous batching with chunked prefill and preemption by recompute (vLLM v1 style).

Every step has a token budget (``max_num_batched_tokens``). Running requests come first, in
the order they started (a decode takes one token, an unfinished prefill its next chunk); then
waiting requests are admitted first come first served while budget, ``max_num_seqs`` and free
blocks allow (the last may get a partial chunk). Short of a block, the most recently started
running request is preempted: blocks freed, progress reset, back to the front of the waiting
queue. An ``n`` > 1 request forks once its prompt is computed; forks beyond ``max_num_seqs``
wait in ``forked`` and take seats before any waiting request. With prefix caching a waiting
request starts from its longest run of cached blocks. Invariant: nothing depends on time, so
the same calls give the same schedule on every rank. docs/engine.md, "Scheduling (vLLM v1
style)"."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from megainfer.config import SchedulerConfig

from .block_manager import BlockManager
from .request import Request, RequestStatus
from .request_queue import RequestQueue


@dataclass
class ScheduledBatch:
    """What one step computes: ``num_new_tokens[i]`` tokens of ``requests[i]``."""

    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.requests)


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager):
        self.config, self.blocks = config, blocks
        self.waiting = RequestQueue()  # to compute from their cache hits: new or preempted
        self.forked = RequestQueue()  # KV computed (forks, hand-overs), waiting for a seat
        self.running = RequestQueue()  # in the order they started running
        self.num_preemptions = 0  # total, for tests and stats

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.forked or self.running)

    @property
    def num_waiting(self) -> int:
        """Sequences not running: new or preempted ones, and forks waiting for a seat."""
        return len(self.waiting) + len(self.forked)

    def queued(self) -> list[Request]:
        """Every unfinished sequence here in queue order: running, forked, waiting."""
        return [*self.running, *self.forked, *self.waiting]

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(batch, budget)
        if not batch.preempted:  # blocks are short: admit nobody new this step
            budget = self._schedule_forked(batch, budget)
        if not batch.preempted and not self.forked:  # forks waiting go before new requests
            self._schedule_waiting(batch, budget)
        return batch

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> int:
        for req in list(self.running):
            if budget <= 0 or req.status != RequestStatus.RUNNING:  # (a preempted victim:
                break  # the ones after it went first)
            need = req.num_tokens - req.num_computed_tokens
            n = min(need, budget)
            if n < need and not self.config.enable_chunked_prefill:
                continue
            while not self.blocks.allocate(req, req.num_computed_tokens + n):
                victim = self._victim(req)
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:  # preempted itself: nothing else fits
                break
            self._run(batch, req, n)
            budget -= n
        return budget

    def _victim(self, req: Request) -> Request:
        """Who gives its blocks back for ``req``: the most recently started running request,
        else (``req`` is the last) the newest fork waiting for a seat, else ``req`` itself."""
        if self.running[-1] is req and self.forked:
            return self.forked.pop()
        return self.running.pop()

    def _schedule_forked(self, batch: ScheduledBatch, budget: int) -> int:
        """Forks waiting for a seat take the seats running sequences left, oldest first, before
        any new request. With nothing running, the newest ones give their blocks back (they
        recompute, as preempted) until the oldest fits: forks holding blocks cannot stall."""
        cap = self.config.max_num_seqs
        while self.forked and budget > 0 and len(self.running) < cap:
            req = self.forked[0]
            need = req.num_tokens - req.num_computed_tokens
            n = min(need, budget)
            if n < need and not self.config.enable_chunked_prefill:
                break
            if not self.blocks.allocate(req, req.num_computed_tokens + n):
                if self.running:
                    break  # blocks come back as running sequences finish
                victim = self.forked.pop()
                self._preempt(victim)
                batch.preempted.append(victim)
                continue
            self.forked.popleft()
            self._run(batch, req, n)
            budget -= n
        return budget

    def _schedule_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        # a request of n samples reserves n seats: its samples fork in once its prompt is done
        # (one of more than max_num_seqs runs alone; its forks beyond the seats wait, forked)
        cap = self.config.max_num_seqs
        seats = sum(1 + len(r.pending) for r in self.running)
        while self.waiting and budget > 0 and seats < cap:
            req = self.waiting[0]
            if seats and seats + 1 + len(req.pending) > cap:
                break
            hits = self._cache_hits(req)
            start = len(hits) * self.blocks.block_size  # its first uncomputed token
            need = req.num_tokens - start
            n = min(need, budget)
            if n < need and not self.config.enable_chunked_prefill:
                break
            if not self.blocks.allocate(req, start + n, cached=hits):
                break
            if req.num_cached_tokens < 0:  # first admission: what the cache served
                req.num_cached_tokens = start
                req.time_in_queue = time.perf_counter() - req.arrival_time
            self.waiting.popleft()
            self._run(batch, req, n)
            budget -= n
            seats += 1 + len(req.pending)

    def _run(self, batch: ScheduledBatch, req: Request, n: int) -> None:
        """``req`` computes ``n`` tokens in this step (it runs from now on if it did not)."""
        if req.status != RequestStatus.RUNNING:
            req.status = RequestStatus.RUNNING
            self.running.append(req)
        batch.requests.append(req)
        batch.num_new_tokens.append(n)

    def _cache_hits(self, req: Request) -> list[int]:
        """Cached blocks of a waiting request's prefix (prefix caching; [] when off). A request
        with ``prompt_logprobs`` skips only positions whose logprobs it has already."""
        pl = req.prompt_logprobs
        return self.blocks.find_cached(req, None if pl is None else len(pl) - 1)

    def add_running(self, req: Request) -> None:
        """A sequence whose computed tokens are in its blocks (a forked sample, a hand-over):
        it runs (the most recently started, the first to be preempted) if a seat is free and
        no fork waits, else it waits in ``forked`` for one, keeping its blocks."""
        if self.forked or len(self.running) >= self.config.max_num_seqs:
            req.status = RequestStatus.WAITING
            self.forked.append(req)
        else:
            req.status = RequestStatus.RUNNING
            self.running.append(req)

    def preempt(self, req: Request) -> None:
        """A running request gives its blocks back from outside a schedule (it recomputes, first
        of the waiting ones)."""
        self.running.discard(req)
        self._preempt(req)

    def _preempt(self, req: Request) -> None:
        self.blocks.free_request(req)
        req.num_computed_tokens = 0
        req.block_uids = []  # its blocks are gone: register the recomputed ones again
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def finish(self, req: Request) -> None:
        """Remove a finished (aborted, handed-over) request from its queue, free its blocks."""
        for q in (self.running, self.forked, self.waiting):
            if q.discard(req):
                break
        self.blocks.free_request(req)
