"""The analytic performance model: what hardware and a model shape cost, and what one
deployment's ping-pong pipeline (or the colocated baseline, or a PD split's two pools) predicts
in closed form (docs/perfmodel.md). Imports nothing from ``sim`` or ``plan``."""
from megainfer.perfmodel.model.chunk_times import ChunkTimes
from megainfer.perfmodel.model.colocated import ColocatedModel, ColocatedPlan, ColocatedPrediction
from megainfer.perfmodel.model.disagg import DisaggModel, Plan, Prediction, Workload
from megainfer.perfmodel.model.fit import fit_attention, fit_line
from megainfer.perfmodel.model.hardware import (HardwareProfile, LayerFit, LinkProfile, NodeProfile,
                                                UnknownHardwareError, hardware_dir, known_hardware,
                                                load_hardware, profile_from_dict,
                                                with_background_load)
from megainfer.perfmodel.model.insitu import fit_error, fit_in_situ, layer_samples
from megainfer.perfmodel.model.layer_times import (FittedTimes, RooflineTimes, allreduce_time,
                                                   layer_times_for, linear_fit_of)
from megainfer.perfmodel.model.pipeline import (balanced_replicas, comm_hidden, m_min,
                                                micro_batch_sizes, t_total, t_total_design)
from megainfer.perfmodel.model.prefill_pool import PrefillPool, decode_model, kv_transfer_s
from megainfer.perfmodel.model.shapes import KV_CACHE_BYTES, ModelShape, dtype_bytes

__all__ = [
    "ChunkTimes", "ColocatedModel", "ColocatedPlan", "ColocatedPrediction", "DisaggModel", "Plan",
    "Prediction", "Workload", "fit_attention", "fit_line", "HardwareProfile", "LayerFit",
    "LinkProfile", "NodeProfile", "UnknownHardwareError", "hardware_dir", "known_hardware",
    "load_hardware", "profile_from_dict", "with_background_load", "fit_error", "fit_in_situ",
    "layer_samples", "FittedTimes", "RooflineTimes", "allreduce_time", "layer_times_for",
    "linear_fit_of", "balanced_replicas", "comm_hidden", "m_min", "micro_batch_sizes", "t_total",
    "t_total_design", "PrefillPool", "decode_model", "kv_transfer_s", "KV_CACHE_BYTES",
    "ModelShape", "dtype_bytes",
]
