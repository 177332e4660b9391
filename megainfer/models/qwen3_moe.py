"""Qwen3-MoE: softmax top-k router renormalised only with ``norm_topk_prob``; RMSNorm on q and k.

Checkpoints store experts per expert as ``mlp.experts.N.{gate,up,down}_proj``.
"""
from .family import Family

QWEN3_MOE = Family(
    name="qwen3_moe",
    renames=(),
    expert_parts={"gate_proj": "gate", "up_proj": "up", "down_proj": "down"},
)
