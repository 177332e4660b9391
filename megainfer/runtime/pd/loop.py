"""The decode replicas' lockstep loop when prefill replicas exist (docs/pd.md).

The same loop as ``ReplicaLoop`` (every attention rank steps every iteration; leaders report to
rank 0; rank 0 answers go or stop), but rank 0 hands requests to prefill ranks through a
``PDRouter`` instead of to the replicas, and its go message carries each replica's transfer
messages (expect / start / drop) instead of new requests; every rank of a replica applies them
(``DecodeSide``) at the same iteration. A leader's report adds the transfers pending on its
replica, which count in its load. When no replica has anything to decode (transfers still
pending or not), rank 0 waits, sleeping, for a prefill report before the next (empty) iteration
instead of spinning: a decode pool waiting for its first prompts leaves the cores to the
prefill ranks. With ``pd.offload`` a leader's report carries its ``OffloadStatus`` and rank 0
sums them (``OffloadTally``; ``offload_report``, the served metrics) and gives rank 0's ledger the
decode iteration's time and round trips (``auto``'s TPOT prediction).
"""
from __future__ import annotations

import time
from typing import Iterable, Optional

from megainfer.engine.outputs import PromptInput, RequestOutput
from megainfer.runtime import tags
from megainfer.runtime.messages import OffloadStatus, ReplicaStatus
from megainfer.runtime.pd.decode import DecodeSide
from megainfer.runtime.pd.offload_report import OffloadTally
from megainfer.runtime.pd.router import PDRouter
from megainfer.runtime.replicas.loop import ReplicaLoop, kv_usage


class PDReplicaLoop(ReplicaLoop):
    routes_requests = False  # decode replicas are not routed by prefix: no key events

    def __init__(self, engine, role, plan, control, exchange, first_moe_layer: int,
                 decode: DecodeSide, router: Optional[PDRouter],
                 tally: Optional[OffloadTally] = None):
        super().__init__(engine, role, plan, control, exchange, first_moe_layer)
        self.decode, self.pd = decode, router
        self.tally = tally  # rank 0 with pd.offload: the replicas' offload reports summed
        self.idle = [0, 0]  # rank 0: iterations with nothing to decode; waits that timed out
        self.last_sync, self.was_decoding = None, False  # rank 0: the last sync, if it decoded

    def _hand_out_first(self, inputs: Iterable[PromptInput]) -> list[PromptInput]:
        """Rank 0: the requests go to the prefill ranks; the replicas' first share is empty."""
        self.pd.add(inputs)
        self._send_to_attention_ranks([[] for _ in self.leaders], tags.REQUESTS,
                                      stream=self.stream)
        return []

    def submit(self, inputs: list[PromptInput]) -> None:
        self.pd.add(inputs)

    def pending_count(self) -> int:
        """Rank 0: requests not handed to a prefill rank yet, and those on one."""
        return len(self.pd.pending) + len(self.pd.router.pending) + len(self.pd.inflight)

    def pending_ids(self) -> set[str]:
        """Rank 0: the ids of the requests not handed to a prefill rank yet (their queue time
        is the prefill rank's from then on)."""
        return {str(inp.request_id) for inp in self.pd.pending} | \
            {str(item[0].request_id) for item in self.pd.router.pending}

    def abort(self, request_id: str) -> Optional[RequestOutput]:
        """Rank 0, online: not handed out, or on a prefill rank (its KV, when it arrives, is
        dropped and its blocks freed): its aborted output now; decoding: its replica ends it
        at the next go (the output comes then)."""
        out, replica = self.pd.abort(request_id)
        if replica is not None:
            self.aborts[replica].append(request_id)
        return out

    def offload_report(self) -> Optional[OffloadStatus]:
        """Rank 0: the decode replicas' offload as last reported, summed, with the round trips
        since the last call (None: no ``pd.offload``)."""
        return None if self.tally is None else self.tally.take()

    def _abort_here(self, request_ids: list[str]) -> list[RequestOutput]:
        rest = [rid for rid in request_ids if not self.decode.abort(rid)]  # KV still coming
        return super()._abort_here(rest)

    def _status(self, finished: list[RequestOutput]) -> ReplicaStatus:
        e, d = self.engine, self.decode
        finished = finished + d.take_aborted()
        for out in finished:
            if out.metrics is not None:
                out.metrics.kv_handoff_s = d.handoff_s.pop(out.request_id, None)
        d.poll()
        return ReplicaStatus(finished, e.has_unfinished(), e.scheduler.num_waiting,
                             len(e.scheduler.running), transfers_pending=d.pending,
                             new_tokens=self.deltas, kv_usage=kv_usage(e),
                             offload=None if d.offload is None else d.offload.status())

    def _observe(self, statuses) -> None:
        """Rank 0 with pd.offload: the last iteration's wall time (when it decoded) and the
        round trips reported, for ``auto``'s TPOT prediction (``OffloadLedger.observe``)."""
        now, ledger = time.perf_counter(), self.pd.offload
        if self.last_sync is not None and self.was_decoding and ledger is not None:
            ledger.observe(now - self.last_sync, tuple(
                t for st in statuses if st.offload is not None for t in st.offload.round_trip_s))
        self.last_sync = now

    def _sync(self, finished: list[RequestOutput]
              ) -> tuple[list[RequestOutput], bool, list, list[str]]:
        d = self.decode
        status = self._status(finished)
        if self.role.rank != 0:
            go = self._follow(status)
            d.apply(go.items)
            return [], go.proceed, [], go.aborts
        done, busy, decoding = [], False, False
        loads = []
        statuses = self._gather(status)
        if self.tally is not None:
            self.tally.add(statuses)
            self._observe(statuses)
        for st in statuses:
            done += st.finished
            busy = busy or st.busy or st.transfers_pending > 0  # decoding, or KV still arriving
            decoding = decoding or st.busy
            loads.append(st.load)
        self.was_decoding = decoding
        if self.pd.offload is not None:  # finished now: not sent home by this hand-out
            for out in done:
                self.pd.offload.finished(out.request_id)
        msgs, prefilled = self.pd.iterate(loads)
        self.new_tokens += self.pd.take_first_tokens()  # sampled on the prefill ranks
        for out in done:
            out.request_id = self.pd.caller_id(out.request_id)
        done += prefilled
        go = (busy or self.pd.busy or self.online) and not self.stop_now
        aborts = self._take_aborts()
        self._send_to_attention_ranks(msgs, tags.GO, proceed=go, aborts=aborts)
        d.apply(msgs[0])
        if not go:
            self.pd.stop()
        elif not decoding:
            self.idle[0] += 1
            if not any(msgs) and (self.pd.busy or not self.online):  # online and idle: the
                self.idle[1] += not self.pd.wait()  # engine core paces the idle iterations
        return done, go, [], aborts[0]
