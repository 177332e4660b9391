"""The attention side of one step in disaggregated mode: the ping-pong micro-batch pipeline.

The engine hands over one ``StepInput``; it is split into m micro-batches balanced by tokens.
For each MoE layer and micro-batch the replica leader routes the tokens, ships them to the
expert ranks (A2E) and, while they compute, runs attention of the next micro-batch; the
experts' partial sums come back (E2A) and are added onto the residual in expert-rank order.

    for layer l, micro-batch i:  finish(l-1, i), pre_mlp(l, i), route, dispatch, shared expert

TP ranks of a replica compute attention together (heads split, all-reduce); the leader does
the exchange and broadcasts the routed output. docs/architecture.md, "One request's and one
hidden state's path across ranks (disaggregated)"."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch

from megainfer.models.attention import AttentionMetadata
from megainfer.perfmodel.trace import ATTENTION, dense_name, span_name
from megainfer.runtime.pipeline.microbatch import split_by_tokens
from megainfer.runtime.trace import Tracer


@dataclass
class _MicroBatch:
    step: object  # StepInput of this micro-batch
    meta: object  # AttentionMetadata
    positions: torch.Tensor  # [n] int64 on the model's device
    hidden: torch.Tensor  # [n, H] residual stream
    residual: Optional[torch.Tensor] = None
    shared: Optional[torch.Tensor] = None
    handle: object = None  # the leader's exchange handle for it (None on TP peers)
    layer: int = -1

    @property
    def in_flight(self) -> bool:
        """A MoE layer's experts are working on this micro-batch (set by dispatch, cleared by
        ``_finish``)."""
        return self.residual is not None

    @property
    def n(self) -> int:
        return int(self.hidden.shape[0])


class DisaggregatedExecutor:
    """``ModelExecutor`` for an attention rank whose routed experts live on expert ranks."""

    deploy_mode = "disaggregated"
    supports_full_logits = True  # every new token's logits when asked (prompt_logprobs)
    # the plug point of decode attention offload (pd.offload, runtime/pd/offload_decode.py, set
    # by runtime/pd/build.py): ``metadata(part, block_size, device) -> (meta, ids, positions)``
    # over the rows attended here; None: every row is
    offload = None

    def __init__(self, model, kv_caches, block_size: int, micro_batches: int, exchange, tp_group,
                 rebalancer=None, tracer: Optional[Tracer] = None):
        self.model, self.kv, self.block_size, self.m = model, kv_caches, block_size, micro_batches
        self.exchange, self.tp = exchange, tp_group  # exchange is None on TP non-leaders
        self.rebalancer = rebalancer  # leaders: replica choice (to_physical) and live EPLB
        self.first_moe = next(i for i, layer in enumerate(model.layers) if layer.is_moe)
        self.device = next(model.parameters()).device
        self.tracer = tracer or Tracer(enabled=False)
        self.iteration = 0
        self.step_log: list[tuple[int, int, float]] = []  # (sequences, tokens, seconds) per step

    @torch.inference_mode()
    def execute(self, step) -> torch.Tensor:
        """StepInput -> logits [len(step.sample_rows), V] float32 (same on every TP rank)."""
        t0 = time.perf_counter()
        if self.rebalancer is not None and self.rebalancer.due(self.iteration):
            self.rebalancer.run(self.iteration, self.first_moe)
        groups = split_by_tokens(step.query_lens, self.m)
        mbs = [self._start(part) for part in step.split(groups)]
        for l, layer in enumerate(self.model.layers):
            for i, mb in enumerate(mbs):
                self._finish(mb, i)
                if layer.is_moe:
                    self._attend_and_dispatch(layer, l, i, mb)
                else:
                    with self.tracer.span(ATTENTION, dense_name(l, i), self.iteration, l, i, mb.n):
                        mb.hidden = layer(mb.hidden, mb.positions, mb.meta, self.kv[l])
        for i, mb in enumerate(mbs):
            self._finish(mb, i)
        hidden = torch.cat([mb.hidden for mb in mbs]) if mbs else None  # [T, H] in batch order
        logits = self._logits(step, groups, mbs, hidden)
        self.iteration += 1
        self.step_log.append((step.num_seqs, step.num_tokens, time.perf_counter() - t0))
        return logits

    # ------------------------------------------------------------------ pieces
    def _start(self, part) -> _MicroBatch:
        """The micro-batch's metadata, ids and positions on the device in one copy."""
        if self.offload is not None:
            meta, ids, pos = self.offload.metadata(part, self.block_size, self.device)
            return _MicroBatch(part, meta, pos, self.model.embed(ids))
        meta, (ids, pos) = AttentionMetadata.build_with(
            part.query_lens, part.context_lens, part.block_tables, self.block_size, self.device,
            extras=[part.input_ids, part.positions])
        return _MicroBatch(part, meta, pos, self.model.embed(ids))

    def _attend_and_dispatch(self, layer, l: int, i: int, mb: _MicroBatch) -> None:
        with self.tracer.span(ATTENTION, span_name(ATTENTION, l, i), self.iteration, l, i, mb.n):
            x, mb.residual = layer.pre_mlp(mb.hidden, mb.positions, mb.meta, self.kv[l])
            w, ids = layer.mlp.gate(x)  # [n, k]
            if self.rebalancer is not None:
                ids = self.rebalancer.to_physical(l, ids)
            if self.exchange is not None:
                mb.handle = self.exchange.dispatch(self.iteration, l, i, x, ids, w)
            mb.shared = layer.mlp.shared(x)
            mb.layer = l

    def _finish(self, mb: _MicroBatch, i: int) -> None:
        """Wait for the micro-batch's experts (if in flight) and add them onto the residual."""
        if not mb.in_flight:
            return
        if self.exchange is not None:
            routed = self.exchange.combine(mb.handle)  # [n, H]
        else:
            routed = torch.empty_like(mb.residual)
        if self.tp is not None and self.tp.size > 1:
            routed = self.tp.broadcast_from_leader(routed, f"routed output L{mb.layer} mb{i}")
        mlp = routed if mb.shared is None else routed + mb.shared
        mb.hidden = mb.residual + mlp
        mb.handle, mb.residual, mb.shared = None, None, None

    def _logits(self, step, groups, mbs, hidden) -> torch.Tensor:
        """Rows of ``step.logit_token_list()`` (each sampled sequence's last token, every token
        of a ``full_logits`` sequence), in that order, from `hidden` in micro-batch order."""
        if not step.sample_rows and not step.full_logits:
            return torch.empty(0, self.model.config.vocab_size, device=self.device)
        rows = torch.tensor(step.logit_token_list([s for g in groups for s in g]),
                            dtype=torch.long)  # `hidden` is in micro-batch order
        if self.device.type == "cuda":  # pinned: the copy does not wait for the device
            rows = rows.pin_memory().to(self.device, non_blocking=True)
        h = self.model.model.norm(hidden[rows])  # [S_sample, H]
        if self.tp is not None and self.tp.size > 1:
            h = self.tp.broadcast_from_leader(h.contiguous(), "final hidden")
        return self.model.compute_logits(h)
