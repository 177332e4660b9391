"""The lockstep loop of all attention ranks; rank 0 drives it for its ``RuntimeEngine``.

Rank 0 keeps the requests (``submit``) and hands them out through a ``RequestRouter``: a first
share with the first iteration (``tags.REQUESTS``), then more every iteration. Each iteration
(one ``iterate`` on rank 0) every attention rank runs ``engine.step()`` (empty when idle, so the
expert ranks get every message); leaders report a ``messages.ReplicaStatus``; rank 0 routes and
answers every attention rank with a ``messages.Go`` (new requests, aborts). Invariant: a
replica's TP ranks get exactly what their leader gets, in the same order, so their schedulers
stay identical. ``close`` runs the iteration that stops every rank. A re-plan's ``replan_hook``
may end the loop with an order; the loops that remain go on (``resume`` / ``resume_online``;
a kept engine's loop takes the old state, ``continue_from``). docs/architecture.md, "One
request's and one hidden state's path across ranks (disaggregated)"; docs/replan.md, "Online"."""
from __future__ import annotations

from typing import Iterable, Iterator, Optional

from megainfer.engine.outputs import PromptInput, RequestOutput
from megainfer.runtime import tags
from megainfer.runtime.control import ControlPlane
from megainfer.runtime.messages import Go, ReplicaStatus
from megainfer.runtime.replicas.request_router import (RequestRouter, prompt_tokens_of,
                                                      tracks_keys)
from megainfer.runtime.roles import RankRole, attention_rank_ids, leader_ranks, replica_of

ANY_REPLICA = -1  # rank 0, online: a request some replica holds, which one unknown (a re-plan)


def kv_usage(engine) -> float:
    b = engine.blocks
    return 1.0 - b.num_free_blocks / max(1, b.num_blocks)


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
        self.carry: list = []  # outputs for the next status (refused or aborted here)
        self.deltas: list = []  # this step's new tokens, reported when streaming
        self.stream = False  # leaders report each step's new tokens (online)
        self.running = False  # the loop runs (rank 0, online: until close's last iteration)
        # rank 0, online (``open_online``): the loop idles instead of stopping; each request's
        # replica until it finishes; the aborts for each replica's next go; the step's tokens
        self.online = self.stop_now = False
        self.started = True  # online: the first share went out (``open_online`` clears it)
        self.where: dict[str, int] = {}
        self.aborts: list[list[str]] = [[] for _ in self.leaders]
        self.new_tokens: list = []
        self.statuses: list[ReplicaStatus] = []  # rank 0: the last iteration's, per replica
        if role.rank == 0:
            self.router = RequestRouter(plan.attention_replicas, sched.routing, cache.block_size,
                                        sched.max_num_seqs, prompt_tokens_of(engine),
                                        use_keys=cache.enable_prefix_caching)

    def _send_to_attention_ranks(self, per_replica: list, tag: int, proceed: bool = True,
                                 aborts=None, stream: bool = False) -> None:
        """Rank 0: each other attention rank a ``Go`` with its replica's entry of
        ``per_replica`` (and of ``aborts``): the TP ranks of a replica get their leader's."""
        for rank in self.attn_ranks[1:]:
            r = replica_of(self.plan, rank)
            self.control.send(Go(proceed, per_replica[r], aborts[r] if aborts else [], stream),
                              rank, tag)

    # ------------------------------------------------------------------ rank 0
    def _hand_out_first(self, inputs: Iterable[PromptInput]) -> list[PromptInput]:
        """Rank 0: the first share to every attention rank (``tags.REQUESTS``); its own."""
        self.router.add(inputs)
        share = self.router.route()
        self._track(share)
        self._send_to_attention_ranks(share, tags.REQUESTS, stream=self.stream)
        return share[0]

    # ------------------------------------------------------------------ rank 0, online
    def open_online(self) -> None:
        """Rank 0: serve requests that arrive while the loop runs (``RuntimeEngine``): the
        loop never stops for lack of work; with ``stream`` (the default online) the replicas
        report each step's new tokens. The first share goes out with the first iteration (what
        was submitted by then), as a batch of requests starts."""
        self.online, self.stream, self.started = True, True, False

    def submit(self, inputs: list[PromptInput]) -> None:
        """Rank 0, online: queue requests; they are handed out at the next iteration."""
        self.router.add(inputs)

    def abort(self, request_id: str) -> Optional[RequestOutput]:
        """Rank 0, online: end a request wherever it is. Not handed out yet: its aborted output
        now. On a replica: that replica's ranks abort it at the next iteration's go, and its
        output (tokens so far, "abort") comes with that iteration (None now)."""
        inp = self.router.take(lambda i: str(i.request_id) == request_id)
        if inp is not None:
            return RequestOutput.aborted(inp.request_id, inp.prompt, inp.prompt_token_ids,
                                         inp.params.n)
        replica = self.where.get(request_id)
        if replica == ANY_REPLICA:  # moved in a re-plan: every replica, its holder ends it
            for per_replica in self.aborts:
                per_replica.append(request_id)
        elif replica is not None:
            self.aborts[replica].append(request_id)
        return None

    def pending_count(self) -> int:
        """Rank 0: requests not handed out yet."""
        return len(self.router.pending)

    def pending_ids(self) -> set[str]:
        """Rank 0: the ids of the requests not handed out yet."""
        return {str(inp.request_id) for inp in self.router.pending}

    def offload_report(self):
        """Rank 0: the decode replicas' attention offload (``messages.OffloadStatus``); None:
        none here (PD's loop answers with ``pd.offload``)."""
        return None

    def iterate(self) -> list[RequestOutput]:
        """Rank 0, online: one iteration of every rank; its finished outputs (the new tokens:
        ``self.new_tokens``). After ``close`` the iteration tells every rank to stop."""
        if not self.started:  # the first: every attention rank's first share before it
            self.started = True
            self._start(self._hand_out_first([]))
        done, go = self._iteration()
        self.running = go
        return done

    def close(self) -> None:
        """Rank 0, online: one last iteration that stops every rank (work left is dropped)."""
        self.online, self.stop_now = False, True
        while self.running or not self.started:
            self.iterate()

    def resume_online(self) -> None:
        """After a re-plan, rank 0 online: iterate again (the other ranks ``resume``)."""
        self._start([])

    def continue_from(self, old: "ReplicaLoop") -> None:
        """A re-plan's loop over a kept engine: the old loop's request ids and hook; on rank 0
        its hand-out queue and online state. Requests may have moved between replicas: rank 0
        no longer knows which one holds each, so an abort of one goes to every replica (its
        holder ends it, the others hold nothing of it); so do the aborts the order held back."""
        self.ids, self.replan_hook = old.ids, old.replan_hook
        if old.router is None:
            return
        self.router.take_over(old.router)
        self.online, self.statuses, self.started = old.online, old.statuses, True
        self.where = dict.fromkeys(old.where, ANY_REPLICA)
        held = [rid for per_replica in old.aborts for rid in per_replica]
        self.aborts = [list(held) for _ in self.leaders]

    # ------------------------------------------------------------------ other attention ranks
    def serve(self) -> None:
        """Attention ranks other than 0: take this replica's requests, run until told to stop."""
        first = self.control.recv(0, tags.REQUESTS, "request hand-out")
        self.stream = first.stream
        for _ in self._loop(first.items):
            pass

    def resume(self) -> None:
        """After a re-plan, attention ranks other than 0: go on until told to stop again."""
        for _ in self._loop([]):
            pass

    # ------------------------------------------------------------------ shared
    def _loop(self, inputs: list[PromptInput]) -> Iterator[RequestOutput]:
        self._start(inputs)
        go = True
        while go:
            done, go = self._iteration()
            yield from done

    def _start(self, inputs: list[PromptInput]) -> None:
        self.engine.detokenize = False  # rank 0's frontend decodes: no text made here
        ids, self.carry = self.engine.add_inputs(inputs, warn=self.role.is_leader)
        self.ids.update(ids)
        self.order, self.running = None, True

    def _iteration(self) -> tuple[list[RequestOutput], bool]:
        """Step, sync with rank 0, take its answer. Returns (outputs for rank 0 to hand on,
        go on)."""
        step = self.engine.step_outputs()
        for out in step.finished:
            out.request_id = self.ids.pop(out.request_id, out.request_id)
        self.deltas = step.new_tokens if self.stream else []
        done, go, new, aborts = self._sync(self.carry + step.finished)
        more, self.carry = self.engine.add_inputs(new, warn=self.role.is_leader)
        self.ids.update(more)
        self.carry += self._abort_here(aborts)
        if not go and self.exchange is not None:
            self.exchange.stop(self.engine.executor.iteration, self.first_moe_layer)
        return done, go

    def _abort_here(self, request_ids: list[str]) -> list[RequestOutput]:
        """Every rank of the replica, at the same iteration: end these requests (their outputs
        go to rank 0 with the next status)."""
        outs = []
        for rid in request_ids:
            out = self.engine.abort_request(rid)
            if out is not None:
                out.request_id = self.ids.pop(out.request_id, out.request_id)
                outs.append(out)
        return outs

    def _track(self, share: list[list]) -> None:
        """Rank 0, online: remember the replica each request went to (until it finishes)."""
        if self.online:
            for replica, items in enumerate(share):
                for inp in items:
                    self.where[str(inp.request_id)] = replica

    def _status(self, finished: list[RequestOutput]) -> ReplicaStatus:
        e = self.engine
        return ReplicaStatus(finished, e.has_unfinished(), e.scheduler.num_waiting,
                             len(e.scheduler.running),
                             e.blocks.take_key_events() if self.track else [],
                             new_tokens=self.deltas, kv_usage=kv_usage(e))

    def _gather(self, status: ReplicaStatus) -> list[ReplicaStatus]:
        """Rank 0: every replica's status (its own first), in replica order; online, the
        step's new tokens of them all become ``self.new_tokens``."""
        got = [status] + [self.control.recv(leader, tags.STATUS,
                                            "iteration sync (replica status)")
                          for leader in self.leaders[1:]]
        self.new_tokens = [d for st in got for d in st.new_tokens]
        self.statuses = got
        for st in got if self.where else ():  # online: requests leave their replica
            for out in st.finished:
                self.where.pop(str(out.request_id), None)
        return got

    def _follow(self, status: ReplicaStatus) -> Go:
        """Attention ranks other than 0: leaders report, everyone takes rank 0's answer."""
        if self.role.is_leader:
            self.control.send(status, 0, tags.STATUS)
        return self.control.recv(0, tags.GO, "iteration sync (waiting for rank 0)")

    def _take_aborts(self) -> list[list[str]]:
        """Rank 0: per replica, the aborts to send with this go (and forget)."""
        out, self.aborts = self.aborts, [[] for _ in self.leaders]
        return out

    def _sync(self, finished: list[RequestOutput]
              ) -> tuple[list[RequestOutput], bool, list, list[str]]:
        """Leaders report to rank 0; rank 0 routes and answers (go, new requests, aborts) to
        every attention rank. Returns (outputs to yield, go, this rank's new requests, the
        requests it aborts)."""
        status = self._status(finished)
        if self.role.rank != 0:
            go = self._follow(status)
            return [], go.proceed, go.items, go.aborts
        done, busy = [], False
        for replica, st in enumerate(self._gather(status)):
            done += st.finished
            busy = busy or st.busy
            self.router.update(replica, st.waiting, st.running, st.key_events)
        work = busy or bool(self.router.pending)
        order = self.replan_hook(self, work) if self.replan_hook is not None else None
        self.order = None if self.stop_now else order  # closing: no switch
        if self.order is not None or self.stop_now:  # end here: no hand-out (a re-plan's
            share, go = [[] for _ in self.leaders], False  # ranks switch roles; or closing)
        else:
            share = self.router.route()
            go = work or any(share) or self.online
        self._track(share)
        # an order's aborts wait for the next loop: the requests may change replica
        aborts = [[] for _ in self.leaders] if self.order is not None else self._take_aborts()
        self._send_to_attention_ranks(share, tags.GO, proceed=go, aborts=aborts)
        return done, go, share[0], aborts[0]
