"""A prefill rank's side of decode attention offload (``pd.offload``): the offload pool and the
attention it serves.

The rank's KV memory is split at start-up: the engine keeps ``cache.num_blocks - pool`` blocks,
``OffloadPool`` holds ``pool`` (``pd.offload_blocks``) with its own block manager. ``keep``
allocates an offloaded request's whole life once its first token is sampled and copies the
prompt's KV in (nothing is sent); ``serve`` answers each ``OffloadQKV`` with ``OffloadOut``
(writes k/v at the next position, runs the layer's backend over the pool); ``OffloadRelease``
frees the blocks, ``OffloadReturn`` sends them home first (``offload_home``). Offloaded attention comes first: ``serve`` runs after every prefill layer and
in every idle wait, so a decode step waits at most about one prefill layer.
docs/pd.md, "Decode attention offloaded to the prefill ranks".
"""
from __future__ import annotations

import logging
import time
from dataclasses import replace

import torch
from mpi4py import MPI

from megainfer.comm.wait import WaitPolicy, wait_until
from megainfer.engine.block_manager import BlockManager
from megainfer.engine.request import Request
from megainfer.engine.sampling_params import SamplingParams
from megainfer.models.attention import AttentionMetadata
from megainfer.runtime import tags
from megainfer.runtime.control import Outbox, RankFailure
from megainfer.runtime.messages import OffloadOut, OffloadRelease, OffloadReturn
from megainfer.runtime.pd.offload_home import HomeSender

log = logging.getLogger("megainfer.runtime")


class OffloadPool:
    """``slices[t]``: (first, count) of this rank's KV heads that decode TP rank ``t`` attends
    (its ``part`` in ``OffloadQKV``); each has its own cache tensors, so one decode rank's
    attention reads and writes its heads only. One slice of every head: decode TP equal to
    prefill TP (each prefill TP rank serves its decode TP peer) or both 1."""

    def __init__(self, engine, model, num_blocks: int, comm: MPI.Comm, me: str,
                 policy: WaitPolicy, segs, slices=None):
        self.comm, self.me, self.policy = comm, me, policy
        self.block_size = engine.cache_config.block_size
        spec, dev = engine.kv_spec, engine.device
        self.axis = spec.block_axis
        self.mla = spec.kind == "mla"  # the latent: no heads to slice
        dt = engine.kv_caches[0].dtype
        if self.mla:
            self.slices = [None]
            self.kv = [spec.allocate(num_blocks, self.block_size, dev, dt)]
        else:
            two, heads, D = spec.shape_per_token
            self.slices = slices or [(0, heads)]
            self.kv = [replace(spec, shape_per_token=(two, n, D)).allocate(
                num_blocks, self.block_size, dev, dt) for _, n in self.slices]  # [part][layer]
        self.blocks = BlockManager(num_blocks, self.block_size)
        self.engine_kv, self.device = engine.kv_caches, dev
        self.attn = [layer.self_attn for layer in model.layers]
        self.held: dict[int, Request] = {}  # xfer -> the holder of its blocks
        self.outbox = Outbox(comm)
        self.served = 0  # OffloadQKV messages answered
        self.serve_s = 0.0  # seconds spent answering them
        self.kept = 0  # requests kept
        # their way home (offload_home): every decode TP rank's slice, then the blocks freed
        self.home = HomeSender(comm, spec.kind, len(model.layers), segs, self.block_size,
                               len(self.slices), me, policy)

    @property
    def num_blocks(self) -> int:
        return self.blocks.num_blocks

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for part in self.kv for t in part)

    def pending(self) -> bool:
        return bool(self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=tags.OFFLOAD_QKV))

    def keep(self, xfer: int, req, num_tokens: int) -> None:
        """Blocks for ``num_tokens`` tokens of ``req`` (its prompt computed in the engine's
        blocks), the prompt's KV copied in. Waits (serving) for the releases rank 0 counted
        on when the pool is short: they were sent before rank 0 handed this request out."""
        holder = Request(-1, f"offload{xfer}", None, [], SamplingParams(), seed=0)
        t0 = time.perf_counter()
        while not self.blocks.allocate(holder, num_tokens):
            self.serve()
            if time.perf_counter() - t0 > self.policy.timeout_s:
                raise RankFailure(self.me, None, f"offload pool release for request "
                                  f"{req.request_id!r} ({self.blocks.num_free_blocks} of "
                                  f"{self.num_blocks} blocks free)", time.perf_counter() - t0)
            wait_until(self.pending, _short(self.policy))
        n = self.blocks.blocks_needed(req.num_prompt_tokens)
        src = torch.tensor(req.block_table[:n], dtype=torch.long, device=self.device)
        dst = torch.tensor(holder.block_table[:n], dtype=torch.long, device=self.device)
        for sl, part in zip(self.slices, self.kv):
            for mine, theirs in zip(part, self.engine_kv):
                blocks = theirs.index_select(self.axis, src)
                if sl is not None:  # GQA [2, NB, BS, H, D]: this slice's heads
                    blocks = blocks[:, :, :, sl[0]:sl[0] + sl[1]]
                mine.index_copy_(self.axis, dst, blocks)
        self.held[xfer] = holder
        self.kept += 1

    def drain(self, within_s: float = 2.0) -> None:
        """At the job's end: take the releases still on their way (every request is done, so
        each was sent); a block still held after ``within_s`` is logged as leaked."""
        t0 = time.perf_counter()
        while self.held and time.perf_counter() - t0 < within_s:
            self.serve()
            wait_until(self.pending, _short(self.policy))
        self.serve()
        self.outbox.flush()
        self.home.drain()
        if self.held:
            log.warning("%s offload pool: requests %s still hold blocks at the end", self.me,
                        sorted(self.held))

    def serve(self) -> int:
        """Answer every offload message that has arrived; returns how many."""
        st, n = MPI.Status(), 0
        while self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=tags.OFFLOAD_QKV, status=st):
            src = st.Get_source()
            msg = self.comm.recv(source=src, tag=tags.OFFLOAD_QKV)
            if isinstance(msg, OffloadRelease):
                for x in msg.xfers:
                    holder = self.held.pop(x, None)
                    if holder is not None:
                        self.blocks.free_request(holder)
                continue
            if isinstance(msg, OffloadReturn):  # its KV goes home, then its blocks are free
                if self.home.send(msg, src, self.kv[msg.part], self.held[msg.xfer].block_table):
                    self.blocks.free_request(self.held.pop(msg.xfer))
                continue
            t0 = time.perf_counter()
            self.outbox.post(OffloadOut(msg.seq, self._attend(msg)), src, tags.OFFLOAD_OUT)
            self.serve_s += time.perf_counter() - t0
            self.served += 1
            n += 1
        self.home.poll()
        return n

    @torch.inference_mode()
    def _attend(self, msg) -> torch.Tensor:
        tables = []
        for x, c in zip(msg.xfers, msg.context_lens):
            table = self.held[x].block_table
            if c + 1 > len(table) * self.block_size:
                raise RuntimeError(f"{self.me}: offloaded request {x} at position {c} is past "
                                   f"its {len(table) * self.block_size} reserved tokens")
            tables.append(table)
        S = len(msg.xfers)
        meta = AttentionMetadata.build([1] * S, list(msg.context_lens), tables, self.block_size,
                                       self.device)
        attn = self.attn[msg.layer]
        dev = self.device
        q, k, v = (t.to(dev) for t in (msg.q, msg.k, msg.v))
        cache = self.kv[msg.part][msg.layer]
        if self.mla:  # q_nope, q_pe, the latent
            return attn.attn_backend(attn, q, k, v, cache, meta).cpu()
        return attn.attn_backend(q, k, v, cache, meta, attn.scale).cpu()


def _short(policy: WaitPolicy) -> WaitPolicy:
    return replace(policy, timeout_s=min(0.05, policy.timeout_s))
