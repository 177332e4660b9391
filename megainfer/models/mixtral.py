"""Mixtral: softmax top-k router, always renormalised; no shared expert, no q/k norm.

Checkpoints name the MoE block ``block_sparse_moe`` and the per-expert projections
w1 (gate), w3 (up), w2 (down); in memory we use the transformers-5 names (``mlp``, fused).
"""
from .family import Family

MIXTRAL = Family(
    name="mixtral",
    renames=(("block_sparse_moe.", "mlp."),),
    expert_parts={"w1": "gate", "w3": "up", "w2": "down"},
)
