"""Prefill-decode disaggregation (``deploy.prefill_replicas > 0``, docs/pd.md): prefill ranks,
layer-wise KV streaming to the decode replicas, rank 0's hand-out and the decode side's loop.
``PD`` is the feature ``runtime/startup.py`` plugs in."""
from megainfer.runtime.pd.build import PD, build_pd_rank
from megainfer.runtime.pd.decode import DecodeSide
from megainfer.runtime.pd.kv_place import place, sender_scales
from megainfer.runtime.pd.kv_routes import Route, check_prefill_tp, routes_to
from megainfer.runtime.pd.kv_segments import (Segments, gather_blocks, host_bytes, kv_tag,
                                              staging_shape)
from megainfer.runtime.pd.kv_stream import Dest, IncomingKV, KVReceiver, KVSender, OutgoingKV
from megainfer.runtime.pd.loop import PDReplicaLoop
from megainfer.runtime.pd.prefill_experts import SplitExpertsMLP, expert_slots_of, split_experts
from megainfer.runtime.pd.prefill_worker import PrefillExecutor, PrefillWorker
from megainfer.runtime.pd.router import PDRouter

__all__ = ["DecodeSide", "Dest", "IncomingKV", "KVReceiver", "KVSender", "OutgoingKV", "PD",
           "PDReplicaLoop", "PDRouter", "PrefillExecutor", "PrefillWorker", "Route", "Segments",
           "SplitExpertsMLP", "build_pd_rank", "check_prefill_tp", "expert_slots_of",
           "gather_blocks", "host_bytes", "kv_tag", "place", "routes_to",
           "sender_scales", "split_experts", "staging_shape"]
