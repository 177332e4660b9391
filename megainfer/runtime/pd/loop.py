"""The decode replicas' lockstep loop when prefill replicas exist (docs/pd.md).

The same loop as ``ReplicaLoop`` (every attention rank steps every iteration; leaders report to
rank 0; rank 0 answers go or stop), but rank 0 hands requests to prefill ranks through a
``PDRouter`` instead of to the replicas, and its go message carries each replica's transfer
messages (expect / start / drop) instead of new requests; every rank of a replica applies them
(``DecodeSide``) at the same iteration. A leader's report adds the transfers pending on its
replica, which count in its load. When no replica has anything to decode (transfers still
pending or not), rank 0 waits, sleeping, for a prefill report before the next (empty) iteration
instead of spinning: a decode pool waiting for its first prompts leaves the cores to the
prefill ranks.
"""
from __future__ import annotations

from typing import Iterable, Iterator, Optional

from megainfer.engine.outputs import PromptInput, RequestOutput

from megainfer.runtime.control import TAG_GO, TAG_REQUESTS, TAG_STATUS
from megainfer.runtime.pd.decode import DecodeSide
from megainfer.runtime.pd.router import PDRouter
from megainfer.runtime.replicas.loop import ReplicaLoop


class PDReplicaLoop(ReplicaLoop):
    def __init__(self, engine, role, plan, control, exchange, first_moe_layer: int,
                 decode: DecodeSide, router: Optional[PDRouter]):
        super().__init__(engine, role, plan, control, exchange, first_moe_layer)
        self.decode, self.pd = decode, router
        self.idle = [0, 0]  # rank 0: iterations with nothing to decode; waits that timed out
        self.track = False  # decode replicas are not routed by prefix: no key events
        blocks = engine.blocks
        blocks.key_events = None  # the base loop may have turned them on
        if blocks.tier is not None:
            blocks.tier.key_events = None

    def generate_stream(self, inputs: Iterable[PromptInput]) -> Iterator[RequestOutput]:
        self.pd.add(inputs)
        for rank in self.attn_ranks[1:]:
            self.control.send([], rank, TAG_REQUESTS)
        yield from self._loop([])

    def _sync(self, finished: list[RequestOutput]) -> tuple[list[RequestOutput], bool, list]:
        e, d = self.engine, self.decode
        for out in finished:
            if out.metrics is not None:
                out.metrics.kv_handoff_s = d.handoff_s.pop(out.request_id, None)
        d.poll()
        status = (finished, len(e.scheduler.waiting), len(e.scheduler.running), d.pending,
                  e.has_unfinished())
        if self.role.rank != 0:
            if self.role.is_leader:
                self.control.send(status, 0, TAG_STATUS)
            go, msgs = self.control.recv(0, TAG_GO, "iteration sync (waiting for rank 0)")
            d.apply(msgs)
            return [], go, []
        done, busy, decoding = list(finished), False, False
        loads = []
        for i, leader in enumerate(self.leaders):
            outs, waiting, running, pending, dec = status if i == 0 else self.control.recv(
                leader, TAG_STATUS, "iteration sync (replica status)")
            if i:
                done += outs
            busy = busy or dec or pending > 0  # decoding, or KV still arriving
            decoding = decoding or dec
            loads.append(waiting + running + pending)
        msgs, prefilled = self.pd.iterate(loads)
        for out in done:
            out.request_id = self.pd.caller_id(out.request_id)
        done += prefilled
        go = busy or self.pd.busy
        for rank in self.attn_ranks[1:]:
            self.control.send((go, msgs[rank // self.plan.attention_tp]), rank, TAG_GO)
        d.apply(msgs[0])
        if not go:
            self.pd.stop()
        elif not decoding:
            self.idle[0] += 1
            if not any(msgs):
                self.idle[1] += not self.pd.wait()
        return done, go, []
