"""A decode rank's side of prefill-decode disaggregation: rank 0's transfer messages, applied at
the same iteration on every TP rank of the replica, so their schedulers stay identical.

* ``Expect``: post the receives from the prefill ranks holding this rank's KV heads and reserve
  the prompt's blocks (first come first served, retried every iteration).
* ``Start``: once the blocks are reserved, wait (bounded) for every layer, scatter them into the
  blocks and start the request.
* ``Drop``: the request ended at the prefill rank: take the KV if it was sent (else cancel the
  receives) and give the blocks back.
* ``OffloadHome`` (``pd.offload``): an offloaded request's KV comes home (``offload_home``),
  once it has started here (at once, or right after its ``Start``).
Online, ``abort`` ends a started request still waiting for blocks or KV as soon as it starts.
docs/pd.md, "What runs where".
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

from megainfer.engine.kv_handoff import release, reserve, start
from megainfer.perfmodel.trace import KV_RECV, kv_transfer_name
from megainfer.runtime.messages import Drop, Expect, OffloadHome, Start
from megainfer.runtime.pd.kv_stream import IncomingKV, KVReceiver
from megainfer.runtime.pd.offload_home import bring_home


@dataclass
class _Expect:
    inc: IncomingKV
    num_tokens: int
    placeholder: object = None  # the reserved blocks (a placeholder Request)
    said: Optional[object] = None  # rank 0's Start or Drop, once it says
    abort: bool = False  # aborted after its Start, before it started: ends as it starts
    src: int = -1  # pd.offload: the prefill rank keeping its KV (``inc`` is None), else -1


class DecodeSide:
    def __init__(self, engine, receiver: KVReceiver, tracer=None, sources=None):
        self.engine, self.receiver, self.tracer = engine, receiver, tracer
        # prefill replica's first rank -> [(rank, heads)] this rank receives from (kv_routes)
        self.sources = sources or (lambda leader: leader)
        self.expects: "OrderedDict[int, _Expect]" = OrderedDict()
        self.handoff_s: dict[str, float] = {}  # request id -> prefill end to decode start
        self.num_started = 0
        self.aborted: list = []  # outputs of requests aborted as they started
        self.offload = None  # pd.offload: the OffloadClient (set by pd/build.py), else None
        self.homing: list[int] = []  # pd.offload: transfers coming home once they start here

    def abort(self, request_id: str) -> bool:
        """End a request whose start is announced but waits for blocks or KV: it ends (output
        in ``take_aborted``) as soon as it starts. False: not waiting here."""
        for e in self.expects.values():
            if isinstance(e.said, Start) and e.said.state.request_id == request_id:
                e.abort = True
                return True
        return False

    def take_aborted(self) -> list:
        out, self.aborted = self.aborted, []
        return out

    @property
    def pending(self) -> int:
        return len(self.expects)

    def apply(self, msgs: list) -> None:
        for m in msgs:
            if isinstance(m, OffloadHome):
                self.homing.append(m.xfer)
            elif isinstance(m, Expect) and m.offload:  # its KV stays there: nothing to receive
                self.expects[m.xfer] = _Expect(None, m.num_tokens, src=m.src)
            elif isinstance(m, Expect):
                bs = self.engine.cache_config.block_size
                inc = self.receiver.post(m.xfer, self.sources(m.src), -(-m.num_tokens // bs),
                                         m.request_id)
                self.expects[m.xfer] = _Expect(inc, m.num_tokens)
            else:
                self.expects[m.xfer].said = m
        self._advance()
        if self.homing:
            self._bring_home()

    def _bring_home(self) -> None:
        """The offloaded requests rank 0 sent home: each started here comes home now (its KV
        moved, or preempted to recompute when blocks are short); one whose ``Start`` is still
        waiting here goes when it starts."""
        wait = []
        for xfer in self.homing:
            if xfer in self.expects:
                wait.append(xfer)
            else:
                bring_home(self.engine, self.offload, self.receiver, xfer)
        self.homing = wait

    def _advance(self) -> None:
        engine = self.engine
        for xfer, e in list(self.expects.items()):
            if e.inc is None:
                self._advance_offloaded(xfer, e)
                continue
            if isinstance(e.said, Drop):
                if e.said.sent:
                    self.receiver.wait(e.inc)
                else:
                    self.receiver.cancel(e.inc)
                if e.placeholder is not None:
                    release(engine, e.placeholder)
                del self.expects[xfer]
                continue
            if e.placeholder is None:
                e.placeholder = reserve(engine, e.num_tokens, f"pd{xfer}")
                if e.placeholder is None:
                    break  # first come first served: the later ones wait too
            if isinstance(e.said, Start):
                state = e.said.state
                self.receiver.wait(e.inc)
                self.receiver.scatter(e.inc, engine.kv_caches, e.placeholder.block_table)
                req = start(engine, state, e.placeholder)
                now = time.perf_counter()
                self.handoff_s[req.request_id] = now - state.t_prefill_end
                self.num_started += 1
                if self.tracer is not None:
                    ep = self.tracer.epoch
                    self.tracer.add(KV_RECV, kv_transfer_name(req.request_id), (e.inc.t_posted - ep) * 1e6,
                                    (e.inc.t_received - e.inc.t_posted) * 1e6, -1, -1, 0,
                                    e.num_tokens)
                del self.expects[xfer]
                if e.abort:
                    self.aborted.append(engine.abort_request(req.request_id))

    def _advance_offloaded(self, xfer: int, e: _Expect) -> None:
        """A request whose KV stays on prefill rank ``e.src``: it starts holding no blocks here
        (``offload_decode``); dropped, the prefill rank frees what it kept."""
        if isinstance(e.said, Drop):
            self.offload.release_xfer(e.src, xfer)
            del self.expects[xfer]
        elif isinstance(e.said, Start):
            engine, state = self.engine, e.said.state
            req = start(engine, state, reserve(engine, 0, f"pd{xfer}"))
            self.offload.adopt(req, e.src, xfer)
            self.handoff_s[req.request_id] = time.perf_counter() - state.t_prefill_end
            self.num_started += 1
            del self.expects[xfer]
            if e.abort:
                self.aborted.append(engine.abort_request(req.request_id))

    def poll(self) -> None:
        """Progress for the receives in flight (called once per iteration)."""
        for e in self.expects.values():
            if e.inc is not None:
                e.inc.test()
