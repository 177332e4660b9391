"""EPLB: expert load statistics, rebalancing with redundant experts, placements."""
from megainfer.eplb.placement import Move, Placement, PlacementError, weight_moves, weight_sends
from megainfer.eplb.placement_policy import EplbError, imbalance, rank_load, rebalance_experts
from megainfer.eplb.stats import ExpertLoadWindow, StatsError, save_heatmap

__all__ = ["EplbError", "PlacementError", "StatsError", "rebalance_experts", "rank_load",
           "imbalance", "Placement", "Move", "weight_moves", "weight_sends",
           "ExpertLoadWindow", "save_heatmap"]
