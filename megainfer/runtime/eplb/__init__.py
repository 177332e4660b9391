"""Live expert placement and expert weight moves (docs/eplb.md): the placement a job starts
from, live rebalancing on both sides, and the device-to-device weight channel; a re-plan's
weight moves (``runtime.replan.weights``) use the same pieces."""
from megainfer.runtime.eplb.initial import initial_placement
from megainfer.runtime.eplb.rebalancer import (AttentionRebalancer, ExpertRebalancer, empty_slot,
                                               install_staged)
from megainfer.runtime.eplb.weight_channel import (Inbound, Outbound, WeightChannel,
                                                   close_weight_channel, eplb_moves_kind, n_chunks,
                                                   open_weight_channel, run_moves, world_ranks_of)

__all__ = ["AttentionRebalancer", "ExpertRebalancer", "Inbound", "Outbound", "WeightChannel",
           "close_weight_channel", "empty_slot", "eplb_moves_kind", "initial_placement",
           "install_staged", "n_chunks", "open_weight_channel", "run_moves", "world_ranks_of"]
