"""The lockstep loop of all attention ranks, and rank 0's view of it as a stream of outputs.

Rank 0 keeps the requests and hands them out a few at a time through a ``RequestRouter``
(``scheduler.routing``: ``round_robin`` | ``cache_aware``, ``request_router.py``): a first
share before the loop (``tags.REQUESTS``), then more every iteration. Every iteration, on every
attention rank: ``engine.step()`` (an empty step when the replica is idle, so the expert ranks
always get every (layer, micro-batch) message); replica leaders report to rank 0 a
``messages.ReplicaStatus`` (finished outputs, whether they have work left, their queue and, for
cache-aware routing, the prefix-cache keys they gained or lost); rank 0 yields the outputs (the
job writes them at once), routes, and tells every attention rank go or stop together with its
replica's new requests (``messages.Go``): the TP ranks of a replica get exactly what their
leader gets, in the same order, so their schedulers stay identical. On stop, leaders send the
expert ranks a stop message.

Re-planning (docs/replan.md): rank 0's ``replan_hook`` may end the loop at an iteration
boundary with an order (``self.order``) instead of a stop; the ranks then switch roles and
the loops that remain go on with ``resume``/``resume_stream``, nothing finished lost.
"""
from __future__ import annotations

from typing import Iterable, Iterator, Optional

from megainfer.engine.outputs import PromptInput, RequestOutput
from megainfer.runtime import tags
from megainfer.runtime.control import ControlPlane
from megainfer.runtime.messages import Go, ReplicaStatus
from megainfer.runtime.replicas.request_router import (RequestRouter, prompt_tokens_of,
                                                      tracks_keys)
from megainfer.runtime.roles import RankRole, attention_rank_ids, leader_ranks, replica_of


class ReplicaLoop:
    routes_requests = True  # rank 0 hands requests to the replicas (PD: to the prefill ranks)

    def __init__(self, engine, role: RankRole, plan, control: ControlPlane, exchange=None,
                 first_moe_layer: int = 0):
        self.engine, self.role, self.plan, self.control = engine, role, plan, control
        self.exchange, self.first_moe_layer = exchange, first_moe_layer  # exchange: leaders only
        self.attn_ranks = attention_rank_ids(plan)
        self.leaders = leader_ranks(plan)
        sched, cache = engine.scheduler_config, engine.cache_config
        # cache-aware routing needs the replicas' keys (decided alike on every rank)
        self.track = self.routes_requests and tracks_keys(sched.routing, plan.attention_replicas,
                                                          cache.enable_prefix_caching)
        if self.track and role.is_leader:
            engine.blocks.track_keys()
        self.router: Optional[RequestRouter] = None
        self.ids: dict = {}  # engine request id -> the caller's id (kept across re-plans)
        # rank 0: (loop, work left) -> an order ending the loop, or None (the re-plan feature's)
        self.replan_hook = None
        self.order = None  # the order that ended the last _loop (None: the job is over)
        if role.rank == 0:
            self.router = RequestRouter(plan.attention_replicas, sched.routing, cache.block_size,
                                        sched.max_num_seqs, prompt_tokens_of(engine),
                                        use_keys=cache.enable_prefix_caching)

    def _send_to_attention_ranks(self, per_replica: list, tag: int, proceed=None) -> None:
        """Rank 0: each other attention rank its replica's entry of ``per_replica`` (as a
        ``Go`` when ``proceed`` is given): the TP ranks of a replica get their leader's."""
        for rank in self.attn_ranks[1:]:
            items = per_replica[replica_of(self.plan, rank)]
            self.control.send(items if proceed is None else Go(proceed, items), rank, tag)

    # ------------------------------------------------------------------ rank 0
    def generate_stream(self, inputs: Iterable[PromptInput]) -> Iterator[RequestOutput]:
        """Rank 0 only: hand out, drive the loop, yield each output as it finishes."""
        self.router.add(inputs)
        share = self.router.route()
        self._send_to_attention_ranks(share, tags.REQUESTS)
        yield from self._loop(share[0])

    # ------------------------------------------------------------------ other attention ranks
    def serve(self) -> None:
        """Attention ranks other than 0: take this replica's requests, run until told to stop."""
        mine = self.control.recv(0, tags.REQUESTS, "request hand-out")
        for _ in self._loop(mine):
            pass

    def resume(self) -> None:
        """After a re-plan, attention ranks other than 0: go on until told to stop again."""
        for _ in self._loop([]):
            pass

    def resume_stream(self) -> Iterator[RequestOutput]:
        """After a re-plan, rank 0: go on driving the loop, yielding outputs."""
        yield from self._loop([])

    # ------------------------------------------------------------------ shared
    def _loop(self, inputs: list[PromptInput]) -> Iterator[RequestOutput]:
        ids, failed = self.engine.add_inputs(inputs, warn=self.role.is_leader)
        self.ids.update(ids)
        ids, go, self.order = self.ids, True, None
        while go:
            finished = self.engine.step()
            for out in finished:
                out.request_id = ids.pop(out.request_id, out.request_id)
            done, go, new = self._sync(failed + finished)
            more, failed = self.engine.add_inputs(new, warn=self.role.is_leader)
            ids.update(more)
            yield from done
        if self.exchange is not None:
            self.exchange.stop(self.engine.executor.iteration, self.first_moe_layer)

    def _status(self, finished: list[RequestOutput]) -> ReplicaStatus:
        e = self.engine
        return ReplicaStatus(finished, e.has_unfinished(), len(e.scheduler.waiting),
                             len(e.scheduler.running),
                             e.blocks.take_key_events() if self.track else [])

    def _gather(self, status: ReplicaStatus) -> list[ReplicaStatus]:
        """Rank 0: every replica's status (its own first), in replica order."""
        return [status] + [self.control.recv(leader, tags.STATUS,
                                             "iteration sync (replica status)")
                           for leader in self.leaders[1:]]

    def _follow(self, status: ReplicaStatus) -> Go:
        """Attention ranks other than 0: leaders report, everyone takes rank 0's answer."""
        if self.role.is_leader:
            self.control.send(status, 0, tags.STATUS)
        return self.control.recv(0, tags.GO, "iteration sync (waiting for rank 0)")

    def _sync(self, finished: list[RequestOutput]) -> tuple[list[RequestOutput], bool, list]:
        """Leaders report to rank 0; rank 0 routes and answers (go, new requests) to every
        attention rank. Returns (outputs to yield, go, this rank's new requests)."""
        status = self._status(finished)
        if self.role.rank != 0:
            go = self._follow(status)
            return [], go.proceed, go.items
        done, busy = [], False
        for replica, st in enumerate(self._gather(status)):
            done += st.finished
            busy = busy or st.busy
            self.router.update(replica, st.waiting, st.running, st.key_events)
        work = busy or bool(self.router.pending)
        self.order = self.replan_hook(self, work) if self.replan_hook is not None else None
        if self.order is not None:  # end this loop here: no hand-out, the ranks switch roles
            share, go = [[] for _ in self.leaders], False
        else:
            share = self.router.route()
            go = work or any(share)
        self._send_to_attention_ranks(share, tags.GO, proceed=go)
        return done, go, share[0]
