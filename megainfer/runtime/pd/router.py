"""Rank 0's side of prefill-decode disaggregation: it keeps the pending requests, hands each to a
prefill rank together with the decode replica that will run it, and turns the prefill ranks'
reports into messages for the decode replicas.

Hand-out is first come first served while a decode replica has room (``max_num_seqs`` over
running + waiting + pending + handed out); the prefill rank comes from the attention replicas'
``RequestRouter`` run over the prefill ranks, the decode replica is the least loaded. The decode
replica gets ``expect`` at once; the prefill rank's report later becomes ``start`` (or
``drop``). A prefill rank with requests outstanding that is silent for ``comm.timeout_s`` is
declared failed (``RankFailure``).
docs/pd.md, "What runs where".
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Optional

from mpi4py import MPI

from megainfer.comm.wait import WaitPolicy, wait_until
from megainfer.engine.errors import RequestError
from megainfer.engine.intake import tokenize_prompt
from megainfer.engine.outputs import PromptInput, RequestOutput, SampleDelta
from megainfer.runtime import tags
from megainfer.runtime.control import Outbox, RankFailure
from megainfer.runtime.messages import (Drop, Expect, OffloadHome, PrefillStop, PrefillWork,
                                        Start, WorkItem)
from megainfer.runtime.replicas.request_router import RequestRouter
from megainfer.runtime.timeouts import pd_idle_wait_s


@dataclass
class _Handout:
    prefill: int  # index into prefill ranks
    replica: int  # decode replica
    request_id: str
    input: PromptInput


class PDRouter:
    def __init__(self, comm: MPI.Comm, prefill_ranks: list[int], num_replicas: int, engine,
                 me: str, policy: WaitPolicy, cap: Optional[int] = None):
        self.comm, self.prefill_ranks, self.A = comm, prefill_ranks, num_replicas
        self.engine, self.me, self.policy = engine, me, policy  # engine: tokenizer and limits
        sched, cache = engine.scheduler_config, engine.cache_config
        self.cap = cap or sched.max_num_seqs
        self.router = RequestRouter(len(prefill_ranks), sched.routing, cache.block_size,
                             sched.max_num_seqs, lambda item: item[1],  # (input, prompt ids)
                             use_keys=cache.enable_prefix_caching)
        self.pending: deque = deque()
        self.inflight: dict[int, _Handout] = {}
        self.outstanding = [0] * len(prefill_ranks)
        self.last_heard = [time.perf_counter()] * len(prefill_ranks)
        self.ids: dict[str, object] = {}  # engine request id -> the caller's id
        self.next_xfer = self.next_d = 0
        self.assigned = [0] * num_replicas  # requests handed to each decode replica
        self.prefilled = [0] * len(prefill_ranks)
        self.outbox = Outbox(comm)  # hand-outs in flight
        self.reports = 0  # prefill reports received
        self.decoding: dict[str, int] = {}  # request id -> decode replica, once started
        self.aborted: set[int] = set()  # transfers whose request was aborted on a prefill rank
        self.first_tokens: list[SampleDelta] = []  # the prefill ranks' sampled tokens (online)
        self.offload = None  # pd.offload: its OffloadLedger (set by pd/build.py), else None
        # nothing to decode anywhere: the next thing that can change that is a prefill report
        # (a first token to start, a request to drop, room for a hand-out), so rank 0 waits for
        # one, sleeping (bounded: well under every other rank's comm.timeout_s)
        self.idle_wait = WaitPolicy(mode=policy.mode, timeout_s=pd_idle_wait_s(policy.timeout_s))

    @property
    def busy(self) -> bool:
        return bool(self.pending or self.router.pending or self.inflight)

    @property
    def tracks_keys(self) -> bool:
        """Whether the prefill ranks must report their prefix-cache key events."""
        return self.router.tracks_keys

    def add(self, inputs) -> None:
        self.pending.extend(inputs)

    def abort(self, request_id: str) -> tuple[Optional[RequestOutput], Optional[int]]:
        """(its aborted output now, None) when the request waits here or is on a prefill rank
        (its transfer is then dropped when the prefill reports); (None, its decode replica)
        when it decodes; (None, None) when unknown or finished."""
        for i, inp in enumerate(self.pending):
            if str(inp.request_id) == request_id:
                del self.pending[i]
                return _aborted(inp), None
        item = self.router.take(lambda it: str(it[0].request_id) == request_id)
        if item is not None:
            return _aborted(item[0]), None
        for xfer, f in self.inflight.items():
            if f.request_id == request_id and xfer not in self.aborted:
                self.aborted.add(xfer)
                self.ids.pop(request_id, None)
                return _aborted(f.input), None
        return None, self.decoding.get(request_id)

    def take_first_tokens(self) -> list[SampleDelta]:
        out, self.first_tokens = self.first_tokens, []
        return out

    def iterate(self, loads: list[int]) -> tuple[list[list], list[RequestOutput]]:
        """``loads[d]``: decode replica d's queue (running + waiting + transfers pending). Returns
        (per decode replica, its messages; outputs finished without decoding)."""
        msgs, done = [[] for _ in range(self.A)], []
        self._collect(msgs, done)
        self._hand_out(list(loads), msgs, done)
        if self.offload is not None:  # sent home for the room (offload_home), before the next step
            for d, xfer in self.offload.take_homes():
                msgs[d].append(OffloadHome(xfer))
        self._check_silence()
        return msgs, done

    def wait(self) -> bool:
        """Nothing to decode: wait (bounded, well under the go timeout) for a report. True when
        one came."""
        return wait_until(lambda: self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=tags.PD_DONE),
                          self.idle_wait) >= 0

    def stop(self) -> None:
        for r in self.prefill_ranks:
            self._send(PrefillStop(), r)
        self.outbox.flush()  # small, and every prefill rank is alive to take it

    def _send(self, msg, rank: int) -> None:
        """Non-blocking: the prefill rank may be sending its report at the same time."""
        self.outbox.post(msg, rank, tags.PD_WORK)

    def _collect(self, msgs, done) -> None:
        st = MPI.Status()
        while self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=tags.PD_DONE, status=st):
            src = st.Get_source()
            report = self.comm.recv(source=src, tag=tags.PD_DONE)
            self.reports += 1
            p = self.prefill_ranks.index(src)
            self.last_heard[p] = time.perf_counter()
            self.router.update(p, report.waiting, report.running, report.key_events)
            if self.offload is not None:
                self.offload.prefill_busy(p, report.busy_s, self.last_heard[p])
            for res in report.results:
                f = self.inflight.pop(res.xfer)
                self.outstanding[p] -= 1
                self.prefilled[p] += 1
                off = self.offload
                if res.xfer in self.aborted:  # its output went out at the abort: drop its KV
                    self.aborted.discard(res.xfer)
                    msgs[f.replica].append(Drop(res.xfer, res.kind != "failed"))
                    if off is not None:
                        off.credit(res.xfer)
                elif res.kind == "state":
                    msgs[f.replica].append(Start(res.xfer, res.payload))
                    self.decoding[f.request_id] = f.replica
                    if off is not None:
                        off.decoding(f.request_id, res.xfer)
                    self.first_tokens += _first_tokens(res.payload)
                else:  # finished at its first token, or refused: nothing to decode
                    out = res.payload
                    out.request_id = self.ids.pop(f.request_id, out.request_id)
                    done.append(out)
                    msgs[f.replica].append(Drop(res.xfer, res.kind == "output"))
                    if off is not None:
                        off.credit(res.xfer)

    def _hand_out(self, loads, msgs, done) -> None:
        room = sum(max(0, self.cap - n) for n in loads)  # what the decode replicas can take
        e = self.engine
        while self.pending and len(self.router.pending) < room:
            inp = self.pending.popleft()
            try:  # tokenized once: the router's keys and the decode side's block count
                _, ids = tokenize_prompt(e.tokenizer, inp.prompt, inp.prompt_token_ids,
                                         e.model_config.vocab_size, e.max_model_len)
            except RequestError as err:
                done.append(RequestOutput.failed(inp.request_id, inp.prompt,
                                                 inp.prompt_token_ids, err))
                continue
            self.router.add([(inp, ids)])
        work = [[] for _ in self.prefill_ranks]
        for p, items in enumerate(self.router.route()):
            for inp, ids in items:
                d = min(range(self.A), key=lambda r: (loads[r], (r - self.next_d) % self.A))
                xfer, self.next_xfer = self.next_xfer, self.next_xfer + 1
                rid = str(inp.request_id)
                self.ids[rid] = inp.request_id
                self.inflight[xfer] = _Handout(p, d, rid, inp)
                if not self.outstanding[p]:
                    self.last_heard[p] = time.perf_counter()  # the silence clock starts now
                self.outstanding[p] += 1
                loads[d] += 1
                self.assigned[d] += 1
                self.next_d = (d + 1) % self.A
                keep = 0 if self.offload is None else self.offload.decide(p, d, xfer, inp, len(ids))
                msgs[d].append(Expect(xfer, self.prefill_ranks[p], len(ids), rid, keep > 0))
                work[p].append(WorkItem(xfer, inp, d, keep))
        for p, items in enumerate(work):
            if items:
                self._send(PrefillWork(items), self.prefill_ranks[p])

    def _check_silence(self) -> None:
        now = time.perf_counter()
        for p, n in enumerate(self.outstanding):
            if n and now - self.last_heard[p] > self.policy.timeout_s:
                rid = next(f.request_id for f in self.inflight.values() if f.prefill == p)
                raise RankFailure(self.me, self.prefill_ranks[p], f"prefill of request {rid!r} "
                                  f"({n} outstanding on prefill {p})", now - self.last_heard[p])

    def caller_id(self, rid):
        """The caller's id of a request decoded here (outputs carry the engine's str id)."""
        self.decoding.pop(rid, None)
        if self.offload is not None:
            self.offload.finished(rid)
        return self.ids.pop(rid, rid)


def _aborted(inp: PromptInput) -> RequestOutput:
    return RequestOutput.aborted(inp.request_id, inp.prompt, inp.prompt_token_ids, inp.params.n)


def _first_tokens(state) -> list[SampleDelta]:
    """Each sample's first token, sampled on the prefill rank (a ``HandoffState``)."""
    return [SampleDelta(s.request_id, s.index, list(s.output_token_ids), s.logprobs,
                        s.finish_reason, s.stop_reason) for s in [state, *state.samples]]
