"""A decode attention rank's side of decode attention offloaded to the prefill ranks
(``pd.offload``).

An offloaded request holds no blocks here: its KV stays on the prefill rank that prefilled it.
``OffloadedAttention`` sends its rows' q/k/v to that rank at every layer (``OffloadQKV``), runs
the local rows meanwhile and waits, bounded, for ``OffloadOut`` (``RankFailure`` names a silent
prefill rank); O projection and the MoE run here for every row. ``RemoteKVBlocks`` allocates
nothing for it and, on free, sends ``OffloadRelease`` after its last ``OffloadQKV``; a preempted
one recomputes here and is local from then on, one sent home (``offload_home``) takes blocks
here for its KV. ``OffloadClient.metadata`` (the executor's
``offload`` hook) builds a micro-batch's metadata over its local rows only; ``status``: the
leader's report to rank 0 each step (``offload_report.py``, the served metrics).
docs/pd.md, "Decode attention offloaded to the prefill ranks".
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch
from mpi4py import MPI

from megainfer.comm.wait import WaitPolicy, wait_until
from megainfer.models.attention import AttentionMetadata
from megainfer.runtime import tags
from megainfer.runtime.control import Outbox, RankFailure
from megainfer.runtime.messages import OffloadQKV, OffloadRelease, OffloadStatus
from megainfer.runtime.pd.offload_report import PENDING_ROUND_TRIPS

PLAN_KEY = "pd.offload"  # meta.step_cache key of a micro-batch's offloaded rows


@dataclass
class _Remote:
    """The offloaded rows of one micro-batch held by one prefill rank."""

    rank: int
    xfers: list
    context_lens: list
    rows: torch.Tensor  # [S] token rows of the micro-batch


@dataclass
class _Plan:
    local: torch.Tensor  # [T_local] token rows attended here
    remotes: list  # [_Remote]


@dataclass
class RoundTrips:
    """Per-layer offload round trips seen by this decode rank: count, seconds from the send to
    the reply, and the part of that waited after the local attention ended (exposed);
    ``pending``: the round trips (s) not reported yet (``take``), the latest
    ``PENDING_ROUND_TRIPS`` at most."""

    count: int = 0
    total_s: float = 0.0
    exposed_s: float = 0.0
    samples_ms: list = field(default_factory=list)  # the first 4096 round trips, ms
    pending: deque = field(default_factory=lambda: deque(maxlen=PENDING_ROUND_TRIPS))

    def add(self, rt: float, exposed: float) -> None:
        self.count += 1
        self.total_s += rt
        self.exposed_s += exposed
        if len(self.samples_ms) < 4096:
            self.samples_ms.append(rt * 1e3)
        self.pending.append(rt)

    def take(self) -> tuple:
        """The round trips (s) since the last call."""
        out = tuple(self.pending)
        self.pending.clear()
        return out

    @property
    def hidden_fraction(self):
        return None if self.total_s <= 0 else 1 - self.exposed_s / self.total_s


class OffloadClient:
    def __init__(self, comm: MPI.Comm, me: str, policy: WaitPolicy, device, offset: int = 0,
                 part: int = 0):
        self.comm, self.me, self.policy, self.device = comm, me, policy, device
        # this decode TP rank's peer: prefill replica's first rank + offset; its head slice there
        self.offset, self.part = offset, part
        self.by_seq: dict[int, tuple[int, int]] = {}  # seq id -> (prefill rank, xfer)
        self.outbox = Outbox(comm)
        self.seq: dict[int, int] = {}  # prefill rank -> messages sent to it
        self.trips = RoundTrips()
        self.started = 0  # offloaded requests started here
        self.returned = 0  # offloaded requests preempted here: they recompute here, local
        self.homed = 0  # offloaded requests whose KV came home (offload_home.bring_home)

    # ---------------------------------------------------------------- lifecycle
    def adopt(self, req, src: int, xfer: int) -> None:
        """``req`` decodes here with its KV on the prefill replica whose first rank is ``src``."""
        self.by_seq[req.seq_id] = (src + self.offset, xfer)
        self.started += 1

    def release(self, seq_id: int) -> bool:
        """The sequence leaves (finish, abort, preemption): its prefill rank frees its
        blocks. False: not offloaded."""
        held = self.by_seq.pop(seq_id, None)
        if held is None:
            return False
        self.outbox.post(OffloadRelease([held[1]]), held[0], tags.OFFLOAD_QKV)
        return True

    def seq_of(self, xfer: int):
        """The sequence id of offloaded transfer ``xfer`` here, None if not offloaded here."""
        return next((s for s, (_, x) in self.by_seq.items() if x == xfer), None)

    def came_home(self, seq_id: int) -> None:
        """The sequence's KV is in this rank's blocks now: it decodes locally."""
        del self.by_seq[seq_id]
        self.homed += 1

    def release_xfer(self, src: int, xfer: int) -> None:
        """A request dropped before it decoded here (prefill replica's first rank ``src``)."""
        self.outbox.post(OffloadRelease([xfer]), src + self.offset, tags.OFFLOAD_QKV)

    @property
    def num_offloaded(self) -> int:
        return len(self.by_seq)

    def status(self) -> OffloadStatus:
        """For the replica's report to rank 0: offloaded now, ever, the round trips since."""
        return OffloadStatus(self.num_offloaded, self.started, self.trips.take(), self.homed)

    # ---------------------------------------------------------------- the step
    def metadata(self, part, block_size: int, device):
        """(meta over the local rows, token ids [T], positions [T]) of a micro-batch."""
        remote = [i for i, s in enumerate(part.seq_ids) if s in self.by_seq]
        extras = [part.input_ids, part.positions]
        if not remote:
            meta, (ids, pos) = AttentionMetadata.build_with(
                part.query_lens, part.context_lens, part.block_tables, block_size, device,
                extras=extras)
            return meta, ids, pos
        local = [i for i, s in enumerate(part.seq_ids) if s not in self.by_seq]
        starts = part.token_offsets()
        meta, (ids, pos) = AttentionMetadata.build_with(
            [part.query_lens[i] for i in local], [part.context_lens[i] for i in local],
            [part.block_tables[i] for i in local], block_size, device, extras=extras)
        groups: dict[int, _Remote] = {}
        for i in remote:
            if part.query_lens[i] != 1:
                raise RuntimeError(f"{self.me}: offloaded sequence {part.seq_ids[i]} has "
                                   f"{part.query_lens[i]} new tokens (decodes only)")
            rank, xfer = self.by_seq[part.seq_ids[i]]
            g = groups.setdefault(rank, _Remote(rank, [], [], []))
            g.xfers.append(xfer)
            g.context_lens.append(part.context_lens[i])
            g.rows.append(starts[i])
        rows = [r for i in local for r in range(starts[i], starts[i + 1])]
        for g in groups.values():
            g.rows = torch.tensor(g.rows, dtype=torch.long, device=device)
        meta.step_cache[PLAN_KEY] = _Plan(torch.tensor(rows, dtype=torch.long, device=device),
                                          list(groups.values()))
        return meta, ids, pos

    def send(self, layer: int, plan: _Plan, q, k, v) -> list:
        """Post one ``OffloadQKV`` per prefill rank; returns what ``receive`` waits for."""
        out = []
        for g in plan.remotes:
            n = self.seq.get(g.rank, 0)
            self.seq[g.rank] = n + 1
            msg = OffloadQKV(n, layer, self.part, g.xfers, g.context_lens, q[g.rows].cpu(),
                             k[g.rows].cpu(), v[g.rows].cpu())
            self.outbox.post(msg, g.rank, tags.OFFLOAD_QKV)
            out.append((g, n, layer, time.perf_counter()))
        return out

    def receive(self, sent: list, out: torch.Tensor) -> None:
        """Each prefill rank's ``OffloadOut`` into its rows of ``out`` [T, Hq, D]."""
        t_local = time.perf_counter()
        for g, n, layer, t0 in sent:
            waited = wait_until(lambda: self.comm.Iprobe(source=g.rank, tag=tags.OFFLOAD_OUT),
                                self.policy)
            if waited < 0:
                raise RankFailure(self.me, g.rank, f"offloaded decode attention of layer "
                                  f"{layer} (requests {g.xfers})", -waited)
            reply = self.comm.recv(source=g.rank, tag=tags.OFFLOAD_OUT)
            if reply.seq != n:
                raise RuntimeError(f"{self.me}: rank {g.rank} answered offload message "
                                   f"{reply.seq}, expected {n}")
            out[g.rows] = reply.out.to(device=out.device, dtype=out.dtype)
            now = time.perf_counter()
            self.trips.add(now - t0, now - max(t_local, t0))


class OffloadedAttention:
    """A layer's attention backend with the offloaded rows' attention on their prefill ranks
    (sent first, so it overlaps the local rows'); no plan in the metadata: the inner backend."""

    graphable = False

    def __init__(self, inner, layer: int, client: OffloadClient):
        self.inner, self.layer, self.client = inner, layer, client
        self.name = inner.name

    def __call__(self, q, k, v, kv_cache, meta, scale):
        plan = meta.step_cache.get(PLAN_KEY) if meta is not None else None
        if plan is None:
            return self.inner(q, k, v, kv_cache, meta, scale)
        return self._split(plan, (q, k, v), q.new_empty(q.shape),
                           lambda loc: self.inner(q[loc], k[loc], v[loc], kv_cache, meta, scale))

    def _split(self, plan, sent: tuple, out: torch.Tensor, local) -> torch.Tensor:
        """The remote rows' tensors ``sent`` first, then ``local(rows)`` for this rank's rows
        into ``out`` while they are away, then the answers into theirs."""
        waiting = self.client.send(self.layer, plan, *sent)
        if plan.local.numel():
            out[plan.local] = local(plan.local)
        self.client.receive(waiting, out)
        return out


class OffloadedMLA(OffloadedAttention):
    """The MLA form (DeepSeek-V3): the backend takes (module, q_nope, q_pe, latent, cache,
    meta); what crosses is q_nope [S, H, Dn], q_pe [S, H, P] (rotary applied) and the new
    latent [S, R+P] (``OffloadQKV``'s q, k, v); the answer is [S, H, V]."""

    def __call__(self, mla, q_nope, q_pe, latent, cache, meta):
        plan = meta.step_cache.get(PLAN_KEY) if meta is not None else None
        if plan is None:
            return self.inner(mla, q_nope, q_pe, latent, cache, meta)
        out = q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], mla.v_head_dim)
        return self._split(plan, (q_nope, q_pe, latent), out, lambda loc: self.inner(
            mla, q_nope[loc], q_pe[loc], latent[loc], cache, meta))


class RemoteKVBlocks:
    """The engine's ``BlockManager`` for a decode engine with offloaded sequences: those hold
    no blocks here (their KV is on a prefill rank); everything else is the wrapped manager's."""

    def __init__(self, inner, client: OffloadClient):
        self._inner, self._client = inner, client
        self._gone: set[int] = set()  # offloaded sequences released here (finished or preempted)

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def allocate(self, req, num_tokens: int, cached=()) -> bool:
        if req.seq_id in self._client.by_seq:
            return True  # the prefill rank reserved its blocks up front
        if req.seq_id in self._gone:  # preempted, now recomputed here: its KV came home
            self._gone.discard(req.seq_id)
            self._client.returned += 1
        return self._inner.allocate(req, num_tokens, cached)

    def take_home(self, req, num_tokens: int) -> bool:
        """Blocks here for the first ``num_tokens`` tokens of offloaded ``req`` (its KV is
        coming home, ``offload_home``); False (nothing changed) when too few are free."""
        return self._inner.allocate(req, num_tokens)

    def free_request(self, req) -> None:
        if self._client.release(req.seq_id):
            req.block_table = []
            self._gone.add(req.seq_id)
            return
        self._inner.free_request(req)

    def cache_full_blocks(self, req) -> None:
        if req.seq_id not in self._client.by_seq:
            self._inner.cache_full_blocks(req)

    def fork(self, parent, child) -> None:
        if parent.seq_id in self._client.by_seq:
            raise RuntimeError(f"request {parent.request_id!r}: an offloaded request cannot "
                               "fork (n > 1 requests are not offloaded)")
        self._inner.fork(parent, child)


def install_decode(engine, comm: MPI.Comm, me: str, policy: WaitPolicy, offset: int = 0,
                   part: int = 0) -> OffloadClient:
    """Give a decode attention rank's engine the offload: its block manager, its executor's
    ``offload`` hook and every layer's attention backend (``OffloadClient`` for the peer)."""
    ex = engine.executor
    client = OffloadClient(comm, me, policy, ex.device, offset, part)
    blocks = RemoteKVBlocks(engine.blocks, client)
    engine.blocks = engine.scheduler.blocks = blocks
    ex.offload = client
    wrap = OffloadedMLA if ex.model.config.is_mla else OffloadedAttention
    for l, layer in enumerate(ex.model.layers):
        attn = layer.self_attn
        attn.attn_backend = wrap(attn.attn_backend, l, client)
    return client
