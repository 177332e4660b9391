"""Which rank does what, and every rank-order computation (docs/design_rules.md, "Rank order").

Attention ranks first, replica-major (replica r, TP rank t is rank ``r * attention_tp + t``),
then expert ranks, then prefill ranks (``deploy.prefill_replicas``, docs/pd.md), each prefill
replica ``prefill_tp`` consecutive ranks. In colocated mode every rank is an attention rank that
also holds an expert-parallel slice. Nothing else in the runtime divides or adds rank numbers:
it asks this module.
"""
from __future__ import annotations

from dataclasses import dataclass

from megainfer.config import DeployPlan


@dataclass(frozen=True)
class RankRole:
    kind: str  # "attention" | "expert" | "prefill"
    rank: int
    world: int
    replica: int = -1  # attention: data-parallel replica
    tp_rank: int = -1  # attention / prefill: rank inside the replica's TP group
    expert_index: int = -1  # expert: 0..expert_ranks-1
    prefill_index: int = -1  # prefill: 0..prefill_replicas-1
    tp_size: int = 1  # attention / prefill: ranks in the replica's TP group

    @property
    def is_attention(self) -> bool:
        return self.kind == "attention"

    @property
    def is_leader(self) -> bool:
        """TP rank 0 of a replica: it talks to the expert ranks for its replica."""
        return self.kind == "attention" and self.tp_rank == 0

    @property
    def is_prefill(self) -> bool:
        return self.kind == "prefill"

    @property
    def leader_rank(self) -> int:
        """The rank of TP rank 0 of this rank's replica (attention and prefill ranks)."""
        return self.rank - self.tp_rank

    @property
    def label(self) -> str:
        """The rank's log label: ``[attn dp0 tp1]``, ``[prefill 0]``, ``[expert 3]``."""
        if self.is_attention:
            return f"[attn dp{self.replica} tp{self.tp_rank}]"
        if self.is_prefill:
            tp = f" tp{self.tp_rank}" if self.tp_size > 1 else ""
            return f"[prefill {self.prefill_index}{tp}]"
        return f"[expert {self.expert_index}]"


def assign_role(plan: DeployPlan, rank: int, world: int) -> RankRole:
    plan.check_world_size(world)
    if rank < plan.attention_ranks:
        return RankRole("attention", rank, world, replica=replica_of(plan, rank),
                        tp_rank=rank % plan.attention_tp, tp_size=plan.attention_tp)
    first_prefill = plan.attention_ranks + plan.expert_ranks
    if plan.prefill_ranks and rank >= first_prefill:
        return RankRole("prefill", rank, world,
                        prefill_index=(rank - first_prefill) // plan.prefill_tp,
                        tp_rank=(rank - first_prefill) % plan.prefill_tp, tp_size=plan.prefill_tp)
    return RankRole("expert", rank, world, expert_index=rank - plan.attention_ranks)


def replica_of(plan: DeployPlan, rank: int) -> int:
    """The attention replica an attention rank belongs to."""
    return rank // plan.attention_tp


def attention_rank(plan: DeployPlan, replica: int, tp_rank: int = 0) -> int:
    """The global rank of TP rank ``tp_rank`` of attention replica ``replica``."""
    return replica * plan.attention_tp + tp_rank


def attention_rank_ids(plan: DeployPlan) -> list[int]:
    return list(range(plan.attention_ranks))


def leader_ranks(plan: DeployPlan) -> list[int]:
    """Global ranks of the replica leaders, in replica order."""
    return [attention_rank(plan, r) for r in range(plan.attention_replicas)]


def expert_rank_ids(plan: DeployPlan) -> list[int]:
    """Global ranks of the expert ranks, in expert order."""
    return list(range(plan.attention_ranks, plan.attention_ranks + plan.expert_ranks))


def prefill_rank_ids(plan: DeployPlan) -> list[int]:
    """Global ranks of the prefill replicas (TP rank 0 of each), in replica order."""
    first = plan.attention_ranks + plan.expert_ranks
    return [first + p * plan.prefill_tp for p in range(plan.prefill_replicas)]


def tp_colour(plan: DeployPlan, role: RankRole) -> int:
    """The ``comm.Split`` colour of a rank's TP communicator: the ranks of one replica share
    one; an expert rank gets one of its own."""
    if role.is_attention:
        return role.replica
    if role.is_prefill:
        return plan.attention_replicas + plan.world_size + role.prefill_index
    return plan.attention_replicas + role.rank
