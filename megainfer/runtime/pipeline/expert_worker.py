"""An expert rank: stateless between iterations. For every (MoE layer, micro-batch) it takes
the tokens of every attention replica, runs the grouped GEMM over its expert slots, and sends
each replica its partial sums. A stop message in the first slot of an iteration ends it."""
from __future__ import annotations

import logging

import torch

from megainfer.comm.spec import KIND_REBALANCE, KIND_STOP
from megainfer.perfmodel.trace import A2E, E2A, EXPERT, span_name, wait_name
from megainfer.runtime.trace import Tracer

log = logging.getLogger("megainfer.runtime")


class ExpertWorker:
    def __init__(self, model, micro_batches: int, exchange, label: str, tracer: Tracer | None = None,
                 rebalancer=None, trace_comm: bool = True):
        self.model, self.m, self.exchange, self.label = model, micro_batches, exchange, label
        self.moe_layers = [i for i, layer in enumerate(model.layers) if layer.is_moe]
        self.tracer = tracer or Tracer(enabled=False)
        self.rebalancer = rebalancer  # EPLB (expert ranks): load window, live weight moves
        # expert ranks trace their receive waits (A2E) and replies (E2A); colocated ranks don't,
        # those lanes already hold their attention side's dispatch and combine
        self.trace_comm = trace_comm
        self.iteration = 0
        # called with this worker after each served iteration (re-planning's samples, the
        # served runtime's span reports); the rank's ``Rank.expert_hooks``, kept across re-plans
        self.iteration_hooks: list = []

    def run(self) -> int:
        """Serve iterations until a stop message; returns the number of iterations served."""
        while self.serve_iteration():
            self.iteration += 1
            if self.rebalancer is not None:
                self.rebalancer.end_iteration()
            for hook in self.iteration_hooks:
                hook(self)
        return self.iteration

    @torch.inference_mode()
    def serve_iteration(self) -> bool:
        for l in self.moe_layers:
            for i in range(self.m):
                if not self.serve_one(self.iteration, l, i):
                    return False
        return True

    def serve_one(self, iteration: int, l: int, i: int) -> bool:
        """Receive every replica's tokens for (layer l, micro-batch i), compute, reply.
        False when the message was a stop."""
        t0 = self.tracer.now_us()
        batch = self.exchange.receive(iteration, l, i)  # one entry per replica
        if batch == KIND_REBALANCE:  # at an iteration boundary; the tokens follow
            self.rebalancer.rebalance()
            batch = self.exchange.receive(iteration, l, i)
        if batch == KIND_STOP:
            return False
        if self.trace_comm:
            n = sum(b[0].shape[0] for b in batch)
            self.tracer.add(A2E, wait_name(A2E, l, i), t0, self.tracer.now_us() - t0,
                            iteration, l, i, n)
        self._compute_and_reply(iteration, l, i, batch)
        return True

    def _compute_and_reply(self, iteration: int, l: int, i: int, batch) -> None:
        counts = [x.shape[0] for x, _, _ in batch]
        n = sum(counts)
        experts = self.model.layers[l].mlp.experts
        with self.tracer.span(EXPERT, span_name(EXPERT, l, i), iteration, l, i, n):
            if n:
                # the messages are views into the transport's slots, on the experts' device
                # (cuda_ipc, nccl, staged mpi) or the host (mpi on cpu)
                x = torch.cat([b[0] for b in batch])  # [n, H]
                ids = torch.cat([b[1] for b in batch]).long()  # [n, k] physical slots
                w = torch.cat([b[2] for b in batch])  # [n, k]
                if self.rebalancer is not None:
                    self.rebalancer.record(l, ids)
                out = experts(x, w.to(x.dtype), ids)  # [n, H] partial sums over local slots
            else:  # on the experts' device and dtype, like a computed one
                out = experts.empty_output()
        if self.trace_comm:
            with self.tracer.span(E2A, span_name(E2A, l, i), iteration, l, i, n):
                self.exchange.reply(iteration, l, i, list(torch.split(out, counts)))
        else:
            self.exchange.reply(iteration, l, i, list(torch.split(out, counts)))
