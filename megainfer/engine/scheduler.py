"""Continuous batching with chunked prefill and preemption by recompute (vLLM v1 style).

Every step has a token budget (``max_num_batched_tokens``). Running requests come first, in
the order they started running: a decode takes one token, an unfinished prefill takes the
next chunk of its prompt. Then waiting requests are admitted first-come-first-served while
budget, ``max_num_seqs`` and free blocks allow; the last one admitted may get a partial
chunk (chunked prefill). When a running request needs a block and none is free, the most
recently started running request is preempted: its blocks are freed, its progress reset to
zero, and it goes back to the front of the waiting queue; it recomputes prompt + generated
tokens later, so its output does not change. With prefix caching a waiting request (new or
preempted) starts from the longest run of cached full blocks of its tokens
(``BlockManager.find_cached``) and only computes the rest. Nothing here depends on time, and
the cache's keys are a deterministic hash: the same calls give the same schedule on every rank.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from megainfer.config import SchedulerConfig

from .block_manager import BlockManager
from .request import Request, RequestStatus


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
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0  # total, for tests and stats

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(batch, budget)
        if not batch.preempted:  # blocks are short: admit nobody new this step
            self._schedule_waiting(batch, budget)
        return batch

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            need = req.num_tokens - req.num_computed_tokens
            n = min(need, budget)
            if n < need and not self.config.enable_chunked_prefill:
                i += 1
                continue
            while not self.blocks.allocate(req, req.num_computed_tokens + n):
                victim = self.running.pop()  # the most recently started request
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:  # preempted itself: nothing else fits
                break
            batch.requests.append(req)
            batch.num_new_tokens.append(n)
            budget -= n
            i += 1
        return budget

    def _schedule_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        # a request of n samples reserves n seats: its samples fork in once its prompt is done
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
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            batch.requests.append(req)
            batch.num_new_tokens.append(n)
            budget -= n
            seats += 1 + len(req.pending)

    def _cache_hits(self, req: Request) -> list[int]:
        """Cached blocks of a waiting request's prefix (prefix caching; [] when off). A request
        with ``prompt_logprobs`` skips only positions whose logprobs it has already."""
        pl = req.prompt_logprobs
        return self.blocks.find_cached(req, None if pl is None else len(pl) - 1)

    def add_running(self, req: Request) -> None:
        """A forked sample: it holds its parent's blocks and computed prompt, so it runs (it is
        the most recently started, the first to be preempted)."""
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    def _preempt(self, req: Request) -> None:
        self.blocks.free_request(req)
        req.num_computed_tokens = 0
        req.block_uids = []  # its blocks are gone: register the recomputed ones again
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def finish(self, req: Request) -> None:
        """Remove a finished (or aborted) request and free its blocks."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.blocks.free_request(req)
