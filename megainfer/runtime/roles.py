"""Which rank does what (docs/design_rules.md, "Rank order"): attention ranks first, replica-major (replica r, TP rank t
is rank r*tp + t), then expert ranks, then prefill ranks (``deploy.prefill_replicas``,
docs/pd.md). In colocated mode every rank is an attention rank that also holds an
expert-parallel slice."""
from __future__ import annotations

from dataclasses import dataclass

from megainfer.config import DeployPlan


@dataclass(frozen=True)
class RankRole:
    kind: str  # "attention" | "expert" | "prefill"
    rank: int
    world: int
    replica: int = -1  # attention: data-parallel replica
    tp_rank: int = -1  # attention: rank inside the replica's TP group
    expert_index: int = -1  # expert: 0..expert_ranks-1
    prefill_index: int = -1  # prefill: 0..prefill_replicas-1

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
    def tag(self) -> str:
        if self.is_attention:
            return f"[attn dp{self.replica} tp{self.tp_rank}]"
        if self.is_prefill:
            return f"[prefill {self.prefill_index}]"
        return f"[expert {self.expert_index}]"


def assign_role(plan: DeployPlan, rank: int, world: int) -> RankRole:
    plan.check_world_size(world)
    if rank < plan.attention_ranks:
        return RankRole("attention", rank, world, replica=rank // plan.attention_tp,
                        tp_rank=rank % plan.attention_tp)
    first_prefill = plan.attention_ranks + plan.expert_ranks
    if plan.prefill_ranks and rank >= first_prefill:
        return RankRole("prefill", rank, world,
                        prefill_index=(rank - first_prefill) // plan.prefill_tp)
    return RankRole("expert", rank, world, expert_index=rank - plan.attention_ranks)


def leader_ranks(plan: DeployPlan) -> list[int]:
    """Global ranks of the replica leaders, in replica order."""
    return [r * plan.attention_tp for r in range(plan.attention_replicas)]


def expert_rank_ids(plan: DeployPlan) -> list[int]:
    """Global ranks of the expert ranks, in expert order."""
    return list(range(plan.attention_ranks, plan.attention_ranks + plan.expert_ranks))


def prefill_rank_ids(plan: DeployPlan) -> list[int]:
    """Global ranks of the prefill replicas (TP rank 0 of each), in replica order."""
    first = plan.attention_ranks + plan.expert_ranks
    return [first + p * plan.prefill_tp for p in range(plan.prefill_replicas)]
