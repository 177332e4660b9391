"""Qwen2-MoE: q/k/v bias; a shared expert gated by sigmoid(shared_expert_gate(x)) added to the
routed output; router renormalised only with ``norm_topk_prob``."""
from .family import Family

QWEN2_MOE = Family(
    name="qwen2_moe",
    renames=(),
    expert_parts={"gate_proj": "gate", "up_proj": "up", "down_proj": "down"},
)
