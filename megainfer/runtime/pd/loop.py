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
from megainfer.runtime import tags
from megainfer.runtime.messages import ReplicaStatus
from megainfer.runtime.pd.decode import DecodeSide
from megainfer.runtime.pd.router import PDRouter
from megainfer.runtime.replicas.loop import ReplicaLoop


class PDReplicaLoop(ReplicaLoop):
    routes_requests = False  # decode replicas are not routed by prefix: no key events

    def __init__(self, engine, role, plan, control, exchange, first_moe_layer: int,
                 decode: DecodeSide, router: Optional[PDRouter]):
        super().__init__(engine, role, plan, control, exchange, first_moe_layer)
        self.decode, self.pd = decode, router
        self.idle = [0, 0]  # rank 0: iterations with nothing to decode; waits that timed out

    def generate_stream(self, inputs: Iterable[PromptInput]) -> Iterator[RequestOutput]:
        self.pd.add(inputs)
        self._send_to_attention_ranks([[] for _ in self.leaders], tags.REQUESTS)
        yield from self._loop([])

    def _status(self, finished: list[RequestOutput]) -> ReplicaStatus:
        e, d = self.engine, self.decode
        for out in finished:
            if out.metrics is not None:
                out.metrics.kv_handoff_s = d.handoff_s.pop(out.request_id, None)
        d.poll()
        return ReplicaStatus(finished, e.has_unfinished(), len(e.scheduler.waiting),
                             len(e.scheduler.running), transfers_pending=d.pending)

    def _sync(self, finished: list[RequestOutput]) -> tuple[list[RequestOutput], bool, list]:
        d = self.decode
        status = self._status(finished)
        if self.role.rank != 0:
            go = self._follow(status)
            d.apply(go.items)
            return [], go.proceed, []
        done, busy, decoding = [], False, False
        loads = []
        for st in self._gather(status):
            done += st.finished
            busy = busy or st.busy or st.transfers_pending > 0  # decoding, or KV still arriving
            decoding = decoding or st.busy
            loads.append(st.load)
        msgs, prefilled = self.pd.iterate(loads)
        for out in done:
            out.request_id = self.pd.caller_id(out.request_id)
        done += prefilled
        go = busy or self.pd.busy
        self._send_to_attention_ranks(msgs, tags.GO, proceed=go)
        d.apply(msgs[0])
        if not go:
            self.pd.stop()
        elif not decoding:
            self.idle[0] += 1
            if not any(msgs):
                self.idle[1] += not self.pd.wait()
        return done, go, []
