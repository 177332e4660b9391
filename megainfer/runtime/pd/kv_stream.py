"""Layer-wise KV streaming from a prefill rank to the ranks of a decode replica.

One transfer moves one request's prompt KV, layer by layer, as raw bytes of the cache's storage
format, in segments of about one prefill chunk; positions past the prompt are zeroed, so its
bytes depend only on the prompt. A decode TP rank gets its own KV heads (``kv_routes``).
``KVSender`` (prefill rank) sends layer l's completed segments non-blocking right after layer l
ran, overlapping layer l+1; ``KVReceiver`` (decode rank) posts one ``Irecv`` per (layer,
segment, sender), waits bounded by ``comm.timeout_s`` naming the prefill rank and the request,
and ``scatter`` places every layer into the reserved blocks (``kv_place``). Every message rides
a communicator of its own. Segments, tags and the gathered bytes: ``kv_segments``.
docs/pd.md, "Layer-wise KV streaming".
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

import torch
from mpi4py import MPI

from megainfer.comm.wait import WaitPolicy, wait_until
from megainfer.runtime.control import RankFailure
from megainfer.runtime.pd.kv_place import place, sender_scales
from megainfer.runtime.pd.kv_segments import (Segments, gather_blocks, host_bytes, kv_tag,
                                              staging_shape)
@dataclass
class Dest:
    rank: int  # world rank (of the KV communicator) of a decode TP rank
    heads: Optional[tuple[int, int]]  # GQA head slice; None: everything (MLA)


@dataclass
class OutgoingKV:
    """One request's transfer on the prefill side."""

    xfer: int
    request_id: str
    dests: list[Dest]
    num_tokens: int  # the prompt's
    blocks: list[int] = field(default_factory=list)  # its block table (refreshed every step)
    sent: set = field(default_factory=set)  # segments posted
    step_segs: list = field(default_factory=list)  # segments this step posts
    final: bool = False  # this step completes the prompt
    layers_this_step: int = 0
    reqs: list = field(default_factory=list)  # MPI requests
    bufs: list = field(default_factory=list)  # kept alive until the sends complete
    nbytes: int = 0
    t_first: float = 0.0  # first Isend posted
    t_compute_end: float = 0.0  # the forward of the step completing the prompt ended
    t_done: float = 0.0  # every send observed complete


class KVSender:
    def __init__(self, comm: MPI.Comm, num_layers: int, kind: str, me: str, policy: WaitPolicy,
                 segs: Segments, block_size: int):
        self.comm, self.L, self.kind, self.me, self.policy = comm, num_layers, kind, me, policy
        self.segs, self.bs = segs, block_size
        self.tag_ub = comm.Get_attr(MPI.TAG_UB)
        self.active: list[OutgoingKV] = []  # posting this step: every layer hook sends for them
        self.open: list[OutgoingKV] = []  # some segments posted, the prompt not complete yet
        self.inflight: list[OutgoingKV] = []  # every segment posted, not all complete
        self.done: list[OutgoingKV] = []  # complete (the owner takes them for its stats)
        self.bytes_sent = 0
        self.messages = 0  # Isends posted: KV segments, and with ``tensor`` scales, their scales

    def begin(self, o: OutgoingKV, blocks: list[int], computed: int, final: bool) -> None:
        """A step computes the request up to ``computed`` tokens (``final``: its prompt is
        then complete): post the segments that step completes."""
        o.blocks, o.final, o.layers_this_step = blocks, final, 0
        nblk = -(-o.num_tokens // self.bs)
        ready = nblk if final else computed // self.bs
        o.step_segs = [j for j in range(self.segs.count(nblk))
                       if j not in o.sent and self.segs.span(j, nblk)[1] <= ready]
        if o.step_segs or final:
            self.active.append(o)

    def send_layer(self, layer: int, kv: torch.Tensor) -> None:
        """After ``layer`` ran: post its KV for every active transfer, then nudge MPI."""
        now = time.perf_counter()
        sc = sender_scales(kv)
        sbuf = None if sc is None else host_bytes(sc.clone())  # one host copy for every message
        for o in self.active:
            nblk = -(-o.num_tokens // self.bs)
            for j in o.step_segs:
                b0, b1 = self.segs.span(j, nblk)
                g = gather_blocks(kv, self.kind, o.blocks[b0:b1], o.num_tokens - b0 * self.bs)
                if self.kind == "gqa":
                    g = g.transpose(0, 1)  # block-major [n, 2, BS, H, D]
                tag = kv_tag(o.xfer, layer, j, self.L, self.segs, self.tag_ub)
                for d in o.dests:
                    part = g if d.heads is None else g[:, :, :, d.heads[0]:d.heads[0] + d.heads[1]]
                    buf = host_bytes(part)
                    o.bufs.append(buf)
                    o.reqs.append(self.comm.Isend([buf, MPI.BYTE], dest=d.rank, tag=tag))
                    o.nbytes += buf.nbytes
                    self.messages += 1
                    if sbuf is not None:  # after the bytes, same tag: received in this order
                        o.bufs.append(sbuf)
                        o.reqs.append(self.comm.Isend([sbuf, MPI.BYTE], dest=d.rank, tag=tag))
                        self.messages += 1
                if not o.t_first:
                    o.t_first = now
            o.layers_this_step += 1
        self.poll()

    def end_step(self) -> None:
        """The step's forward is over: its segments have every layer posted."""
        now = time.perf_counter()
        for o in self.active:
            if o.step_segs and o.layers_this_step != self.L:
                raise RuntimeError(f"{self.me} request {o.request_id!r}: {o.layers_this_step} "
                                   f"of {self.L} layers sent")
            o.sent.update(o.step_segs)
            o.step_segs = []
            if o.final:
                o.t_compute_end = now
                if o in self.open:
                    self.open.remove(o)
                self.inflight.append(o)
            elif o not in self.open:
                self.open.append(o)
        self.active = []
        self.poll()

    def poll(self) -> None:
        """Complete what MPI has completed (progress for every posted send)."""
        still = []
        for o in self.inflight:
            if MPI.Request.Testall(o.reqs):
                o.t_done, o.bufs, o.reqs = time.perf_counter(), [], []
                self.bytes_sent += o.nbytes
                self.done.append(o)
            else:
                still.append(o)
        self.inflight = still
        for o in self.active + self.open:  # progress for the segments already posted
            MPI.Request.Testall(o.reqs)

    def drain(self) -> None:
        """Wait (bounded) until every posted transfer completed; names the decode rank."""
        for o in list(self.inflight):
            waited = wait_until(lambda: MPI.Request.Testall(o.reqs), self.policy)
            if waited < 0:
                raise RankFailure(self.me, o.dests[0].rank,
                                  f"KV transfer of request {o.request_id!r}", -waited)
        self.poll()


@dataclass
class IncomingKV:
    """One request's transfer on a decode rank: staging buffers and a receive per layer segment.
    Several senders (a tensor-parallel prefill replica) each send a run of this rank's heads."""

    xfer: int
    src: int  # the first sender's rank (named when the transfer is late)
    request_id: str
    bufs: list  # per layer: per sender, staging tensor (block-major)
    reqs: list  # per (layer, segment, sender): MPI request(s)
    scales: list  # per layer: per sender, its float32 [2] scales (``scaled``), else None
    heads: list = field(default_factory=list)  # per sender: (first head here, count) or None
    t_posted: float = 0.0
    t_received: float = 0.0

    def test(self) -> bool:
        if not self.t_received and MPI.Request.Testall(self.reqs):
            self.t_received = time.perf_counter()
        return bool(self.t_received)


class KVReceiver:
    def __init__(self, comm: MPI.Comm, kind: str, layer_shape: tuple, dtype: torch.dtype,
                 num_layers: int, me: str, policy: WaitPolicy, segs: Segments, parts: tuple = (),
                 scaled: bool = False):
        """``scaled``: every segment carries the sender's per-layer float32 scales (a quantised
        cache with ``tensor`` granularity: ``sender_scales`` is not None on both sides)."""
        self.comm, self.kind, self.layer_shape, self.dtype = comm, kind, layer_shape, dtype
        self.segs = segs
        self.parts = parts  # MLA: (R, P), quantised apart
        self.scaled = scaled
        self.L, self.me, self.policy = num_layers, me, policy
        self.tag_ub = comm.Get_attr(MPI.TAG_UB)
        self.bytes_received = 0

    def post(self, xfer: int, src, num_blocks: int, request_id: str,
             order: Optional[list[int]] = None) -> IncomingKV:
        """One ``Irecv`` per (layer, segment, sender) (``order``: the layers' posting order, for
        tests; any order works). ``src``: the sender's rank, or ``[(rank, heads)]`` in the order
        of this rank's heads (``heads``: how many of them that sender sends; None: all). Every
        segment carries the layer's scales (``scaled``): they are set once per sender, so the
        last one received is as good as any."""
        srcs = [(src, None)] if isinstance(src, int) else list(src)
        heads, h0 = [], 0
        for _, n in srcs:
            heads.append(None if n is None else (h0, n))
            h0 += n or 0
        bufs = [[torch.empty(staging_shape(self.kind, self.layer_shape, num_blocks, n),
                             dtype=self.dtype) for _, n in srcs] for _ in range(self.L)]
        scales = [[torch.zeros(2, dtype=torch.float32) if self.scaled else None for _ in srcs]
                  for _ in range(self.L)]
        reqs = []
        for l in (order if order is not None else range(self.L)):
            for j in range(self.segs.count(num_blocks)):
                b0, b1 = self.segs.span(j, num_blocks)
                tag = kv_tag(xfer, l, j, self.L, self.segs, self.tag_ub)
                for k, (rank, _) in enumerate(srcs):
                    reqs.append(self.comm.Irecv([host_bytes(bufs[l][k][b0:b1]), MPI.BYTE],
                                                source=rank, tag=tag))
                    if scales[l][k] is not None:
                        reqs.append(self.comm.Irecv([host_bytes(scales[l][k]), MPI.BYTE],
                                                    source=rank, tag=tag))
        return IncomingKV(xfer, srcs[0][0], request_id, bufs, reqs, scales, heads,
                        time.perf_counter())

    def wait(self, inc: IncomingKV) -> None:
        waited = wait_until(inc.test, self.policy)
        if waited < 0:
            raise RankFailure(self.me, inc.src, f"KV transfer of request {inc.request_id!r} "
                              f"(prefill rank {inc.src} sent {self._layers_in(inc)} of "
                              f"{self.L} layers)", -waited)

    def _layers_in(self, inc: IncomingKV) -> int:
        per = len(inc.reqs) // self.L  # messages per layer
        return sum(1 for r in inc.reqs if r.Test()) // per

    def scatter(self, inc: IncomingKV, kv_caches: list[torch.Tensor], blocks: list[int]) -> None:
        """Every layer's staged blocks into the reserved ``blocks`` of the paged cache (each
        sender's into its heads, with its scales)."""
        for kv, bufs, scs in zip(kv_caches, inc.bufs, inc.scales):
            for buf, sc, heads in zip(bufs, scs, inc.heads):
                if self.kind == "gqa":
                    buf = buf.transpose(0, 1)  # block-major -> the cache's [2, n, BS, h, D]
                place(kv, self.kind, blocks, buf, sc, self.parts, heads)
                self.bytes_received += buf.numel() * buf.element_size()
        inc.bufs = []

    def cancel(self, inc: IncomingKV) -> None:
        """The prefill rank will send nothing (the request was refused there)."""
        for r in inc.reqs:
            if not r.Test():
                r.Cancel()
                r.Wait()
        inc.bufs = []
