"""The lockstep loop of all attention ranks, and rank 0's view of it as a stream of outputs.

Rank 0 splits the requests over the replicas (request i -> replica i mod A) and sends each
attention rank its replica's share. Then every iteration, on every attention rank:
``engine.step()`` (an empty step when the replica is idle, so the expert ranks always get
every (layer, micro-batch) message); replica leaders report finished outputs and whether they
have work left to rank 0; rank 0 yields the outputs (the job writes them at once) and tells
every attention rank to go on or stop. On stop, leaders send the expert ranks a stop message.
"""
from __future__ import annotations

from typing import Iterable, Iterator

from megainfer.engine.outputs import PromptInput, RequestOutput

from .control import TAG_GO, TAG_REQUESTS, TAG_STATUS, ControlPlane
from .roles import RankRole


class ReplicaLoop:
    def __init__(self, engine, role: RankRole, plan, control: ControlPlane, exchange=None,
                 first_moe_layer: int = 0):
        self.engine, self.role, self.plan, self.control = engine, role, plan, control
        self.exchange, self.first_moe_layer = exchange, first_moe_layer  # exchange: leaders only
        self.attn_ranks = list(range(plan.attention_ranks))
        self.leaders = [r * plan.attention_tp for r in range(plan.attention_replicas)]

    # ------------------------------------------------------------------ rank 0
    def generate_stream(self, inputs: Iterable[PromptInput]) -> Iterator[RequestOutput]:
        """Rank 0 only: distribute, drive the loop, yield each output as it finishes."""
        inputs = list(inputs)
        share = {r: [] for r in range(self.plan.attention_replicas)}
        for i, inp in enumerate(inputs):
            share[i % self.plan.attention_replicas].append(inp)
        for rank in self.attn_ranks[1:]:
            self.control.send(share[rank // self.plan.attention_tp], rank, TAG_REQUESTS)
        yield from self._loop(share[0])

    # ------------------------------------------------------------------ other attention ranks
    def serve(self) -> None:
        """Attention ranks other than 0: take this replica's requests, run until told to stop."""
        mine = self.control.recv(0, TAG_REQUESTS, "request hand-out")
        for _ in self._loop(mine):
            pass

    # ------------------------------------------------------------------ shared
    def _loop(self, inputs: list[PromptInput]) -> Iterator[RequestOutput]:
        ids, failed = self.engine.add_inputs(inputs, warn=self.role.is_leader)
        go = True
        while go:
            finished = self.engine.step()
            for out in finished:
                out.request_id = ids.pop(out.request_id, out.request_id)
            done, go = self._sync(failed + finished)
            failed = []
            yield from done
        if self.exchange is not None:
            self.exchange.stop(self.engine.executor.iteration, self.first_moe_layer)

    def _sync(self, finished: list[RequestOutput]) -> tuple[list[RequestOutput], bool]:
        """Leaders report to rank 0; rank 0 answers go/stop to every attention rank."""
        busy = self.engine.has_unfinished()
        if self.role.rank != 0:
            if self.role.is_leader:
                self.control.send((finished, busy), 0, TAG_STATUS)
            return [], self.control.recv(0, TAG_GO, "iteration sync (waiting for rank 0)")
        done = list(finished)
        for leader in self.leaders[1:]:
            outs, b = self.control.recv(leader, TAG_STATUS, "iteration sync (replica status)")
            done += outs
            busy = busy or b
        for rank in self.attn_ranks[1:]:
            self.control.send(busy, rank, TAG_GO)
        return done, busy
