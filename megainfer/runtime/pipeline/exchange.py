"""Hidden states between attention replicas and expert ranks, over two ``megainfer.comm`` channels.

A2E (``M2N.a2e``, leaders -> expert ranks): for each (layer, micro-batch) every replica leader sends
each expert rank the tokens that have at least one of their top-k slots there:
``hidden [n_j, H]``, ``ids [n_j, k]`` (physical slots, int32), ``weights [n_j, k]`` (fp32);
an empty message when it has none. E2A (N2M): each expert rank answers with the partial sums
``hidden [n_j, H]`` over its own slots; the leader adds them in expert-rank order, on the
device of the parts. On a GPU the rows for each expert rank are found on the device and their
counts copied to the host once per (layer, micro-batch) (``rows_per_rank``): the message
headers then travel on the host, so nothing else waits for the device.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megainfer.comm import M2N, combine_spec, dispatch_spec, make_transports
from megainfer.comm.spec import KIND_REBALANCE, KIND_STOP
from megainfer.perfmodel.trace import A2E, E2A, span_name
from megainfer.runtime.trace import Tracer


def make_m2n(comm, leaders: list[int], experts: list[int], hidden: int, top_k: int,
             capacity: int, micro_batches: int, dtype: torch.dtype, wait,
             transport: str = "mpi", device=None) -> M2N:
    """Both channels, built on every rank of ``comm`` in the same order, holding tensors of
    ``device`` (default cpu) and moved by ``transport`` (``megainfer.comm.select``)."""
    return M2N(make_transports(transport, comm, device=device), leaders, experts,
               dispatch_spec(capacity, hidden, top_k, dtype), combine_spec(capacity, hidden, dtype),
               micro_batches=micro_batches, wait=wait)


def rows_per_rank(owner: torch.Tensor, ranks: int) -> list[torch.Tensor]:
    """owner [n, k] expert-rank index of each chosen slot -> per rank j, the rows (ascending)
    with at least one slot there. One device -> host copy (the counts) per call: the one
    synchronisation of a (layer, micro-batch) on the attention side (docs/comm.md)."""
    n = owner.shape[0]
    mask = torch.zeros(n, ranks, dtype=torch.bool, device=owner.device)
    mask.scatter_(1, owner, True)  # [n, N]
    counts = mask.sum(0).tolist()  # [N] host ints
    order = torch.argsort((~mask).t().to(torch.int8), dim=1, stable=True)  # [N, n]: hits first
    return [order[j, :c] for j, c in enumerate(counts)]


@dataclass
class _Dispatched:
    iteration: int
    layer: int
    mb: int
    n: int
    index: list  # per expert rank: rows of this micro-batch sent there [n_j]
    replies: list  # per expert rank: RecvHandle of its partial sums


class AttentionExchange:
    """Leader side: ``dispatch`` ships a micro-batch's tokens, ``combine`` collects the sums.

    ``partner``: colocated mode's own ``ExpertExchange``. Then each channel's sends and
    receives of a (layer, micro-batch) are issued together in one group (``dispatch`` posts
    the expert side's receives, ``ExpertExchange.reply`` this side's): on NCCL a posted
    receive holds its stream until the peer sends, so a rank that both sends and receives on
    one communicator must issue them as one group or deadlock."""

    def __init__(self, m2n: M2N, slot_owner: torch.Tensor, tracer: Tracer | None = None,
                 lanes: tuple[str, str] = (A2E, E2A), partner: "ExpertExchange | None" = None):
        self.m2n, self.experts, self.lanes = m2n, m2n.expert_ranks, lanes
        self.slot_owner = slot_owner  # [num_slots] int64: expert-rank index holding each slot
        self.tracer = tracer or Tracer()  # a disabled tracer records nothing
        self.partner, self._replies = partner, {}  # colocated: (it, layer, mb) -> handles
        if partner is not None:
            partner.partner = self

    def dispatch(self, iteration: int, layer: int, mb: int, x: torch.Tensor, ids: torch.Tensor,
                 w: torch.Tensor) -> _Dispatched:
        """x [n, H], ids [n, k] physical slots, w [n, k] -> handle for ``combine``."""
        with self.tracer.span(self.lanes[0], span_name(self.lanes[0], layer, mb), iteration,
                              layer, mb, x.shape[0]):
            index = rows_per_rank(self.slot_owner[ids], len(self.experts))  # [n_j] per rank
            replies = None
            if self.partner is None:
                replies = [self.m2n.e2a.recv(r, layer=layer, micro_batch=mb,
                                                 iteration=iteration) for r in self.experts]
            ids32, w32 = ids.to(torch.int32), w.to(torch.float32)
            with self.m2n.a2e.group():
                for r, rows in zip(self.experts, index):
                    self.m2n.a2e.send(r, iteration=iteration, layer=layer, micro_batch=mb,
                                      hidden=x[rows], topk_ids=ids32[rows], topk_weights=w32[rows])
                if self.partner is not None:
                    self.partner.post(iteration, layer, mb)
        return _Dispatched(iteration, layer, mb, x.shape[0], index, replies)

    def post_replies(self, iteration: int, layer: int, mb: int) -> None:
        """Colocated: this (layer, micro-batch)'s combine receives, issued by the partner."""
        self._replies[(iteration, layer, mb)] = [
            self.m2n.e2a.recv(r, layer=layer, micro_batch=mb, iteration=iteration)
            for r in self.experts]

    def combine(self, flight: _Dispatched) -> torch.Tensor:
        """Wait for every expert rank's partial sums; their sum [n, H] in expert-rank order,
        on the device and in the dtype of the parts."""
        f, out = flight, None
        if f.replies is None:
            f.replies = self._replies.pop((f.iteration, f.layer, f.mb))
        with self.tracer.span(self.lanes[1], span_name(self.lanes[1], f.layer, f.mb),
                              f.iteration, f.layer, f.mb, f.n):
            for rows, handle in zip(f.index, f.replies):
                msg = handle.wait()
                part = msg["out"]  # [n_j, H]
                if out is None:
                    out = torch.zeros(f.n, part.shape[1], dtype=part.dtype, device=part.device)
                if rows.numel():
                    out.index_add_(0, rows, part)
                msg.release()
        return out

    def stop(self, iteration: int, first_layer: int) -> None:
        """Tell every expert rank the job is over (in the slot of the next iteration's first
        message), and wait until the messages left."""
        for h in self.m2n.stop(iteration=iteration, layer=first_layer, micro_batch=0):
            h.wait()


class ExpertExchange:
    """Expert side: ``receive`` every replica's tokens for a (layer, micro-batch), ``reply``."""

    def __init__(self, m2n: M2N):
        self.m2n, self.leaders = m2n, m2n.attn_ranks
        self._held = []
        self._posted = {}  # colocated: (it, layer, mb) -> handles posted by the partner's dispatch
        self.partner: AttentionExchange | None = None

    def post(self, iteration: int, layer: int, mb: int) -> None:
        """Colocated: post this (layer, micro-batch)'s receives now (inside the dispatch group)."""
        self._posted[(iteration, layer, mb)] = [
            self.m2n.a2e.recv(a, layer=layer, micro_batch=mb, iteration=iteration)
            for a in self.leaders]

    def receive(self, iteration: int, layer: int, mb: int):
        """[(hidden [n_a, H], ids [n_a, k], weights [n_a, k]) per replica], or the control
        kind (``KIND_STOP`` / ``KIND_REBALANCE``) when the replicas sent one instead."""
        handles = self._posted.pop((iteration, layer, mb), None)
        if handles is None:
            handles = [self.m2n.a2e.recv(a, layer=layer, micro_batch=mb, iteration=iteration)
                       for a in self.leaders]
        msgs = [h.wait() for h in handles]
        kinds = {m.kind for m in msgs}
        if kinds & {KIND_STOP, KIND_REBALANCE}:
            for m in msgs:
                m.release()
            if len(kinds) > 1:
                raise RuntimeError(f"replicas disagree at iteration {iteration}: message kinds "
                                   f"{sorted(kinds)} for layer {layer} micro-batch {mb}")
            return kinds.pop()
        self._held = msgs  # views stay valid until reply() releases them
        return [(m["hidden"], m["topk_ids"], m["topk_weights"]) for m in msgs]

    def reply(self, iteration: int, layer: int, mb: int, outs: list[torch.Tensor]) -> None:
        with self.m2n.e2a.group():
            for a, out in zip(self.leaders, outs):
                self.m2n.e2a.send(a, iteration=iteration, layer=layer, micro_batch=mb, out=out)
            if self.partner is not None:
                self.partner.post_replies(iteration, layer, mb)
        for m in self._held:
            m.release()
        self._held = []
