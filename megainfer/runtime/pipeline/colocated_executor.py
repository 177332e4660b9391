"""Colocated mode (vLLM Wide-EP style): every rank is an attention replica *and* holds an
expert-parallel slice of the experts. Dispatch and combine are all-to-all among all ranks over
the same channels; before combining a micro-batch, each rank serves its experts' share of that
(layer, micro-batch) for every rank. With ``micro_batches=2`` the dispatch of one micro-batch
overlaps the attention of the other (two-batch overlap, DBO style).

The same engine, kernels and sampling as the disaggregated mode, so a comparison between the
two isolates the architecture.
"""
from __future__ import annotations

from megainfer.runtime.pipeline.attention_executor import DisaggregatedExecutor


class ColocatedExecutor(DisaggregatedExecutor):
    deploy_mode = "colocated"

    def __init__(self, model, kv_caches, block_size, micro_batches, exchange, expert_worker,
                 rebalancer=None, tracer=None):
        super().__init__(model, kv_caches, block_size, micro_batches, exchange, None,
                         rebalancer=rebalancer, tracer=tracer)
        self.worker = expert_worker  # serves this rank's slots for every rank's tokens

    def _finish(self, mb, i: int) -> None:
        if mb.in_flight:
            self.worker.serve_one(self.iteration, mb.layer, i)
        super()._finish(mb, i)
