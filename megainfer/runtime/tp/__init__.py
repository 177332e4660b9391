"""Tensor parallelism inside one attention (or prefill) replica: the group's collectives over
MPI, or point to point over the device transport (``comm.tp_collectives``)."""
from megainfer.runtime.tp.channel import TPChannel, tp_capacity, tp_collectives_kind
from megainfer.runtime.tp.group import TPGroup, late_peer, make_tp_group

__all__ = ["TPChannel", "TPGroup", "late_peer", "make_tp_group", "tp_capacity",
           "tp_collectives_kind"]
