"""The colocated baseline: every device holds attention (TP over the group) and an EP slice of
the experts; dispatch / combine are all-to-alls inside the group (vLLM Wide-EP style).

m = 1 runs attention, dispatch, experts, combine in sequence; m = 2 is two-micro-batch overlap
(DBO): one micro-batch computes while the other communicates.
"""
from __future__ import annotations

from dataclasses import dataclass

from megainfer.config import ConfigError
from megainfer.perfmodel.model.disagg import Workload
from megainfer.perfmodel.model.layer_times import RooflineTimes
from megainfer.perfmodel.model.shapes import ModelShape, dtype_bytes


@dataclass(frozen=True)
class ColocatedPlan:
    group: int  # devices per group: attention TP degree = EP degree
    m: int  # 1: sequential, 2: two-micro-batch overlap
    batch: int  # sequences per group
    hw: str = ""

    def __post_init__(self):
        if self.group < 1 or self.m not in (1, 2) or self.batch < 0:
            raise ConfigError(f"colocated plan group={self.group}, m={self.m}, batch={self.batch}: "
                              "group >= 1, m in (1, 2), batch >= 0")

    def label(self) -> str:
        return f"colocated tp{self.group}/ep{self.group} m={self.m}" + (f" [{self.hw}]" if self.hw else "")


@dataclass(frozen=True)
class ColocatedPrediction:
    plan: ColocatedPlan
    t_layer: float
    t_iter: float
    mem: float  # bytes per device
    cost_per_hour: float

    @property
    def tokens_per_s(self) -> float:
        return self.plan.batch / self.t_iter if self.t_iter > 0 else 0.0

    @property
    def tokens_per_s_per_device(self) -> float:
        return self.tokens_per_s / self.plan.group

    @property
    def tokens_per_dollar(self) -> float:
        return self.tokens_per_s * 3600 / self.cost_per_hour


class ColocatedModel:
    def __init__(self, shape: ModelShape, times: RooflineTimes, workload: Workload,
                 act_dtype: str = "bfloat16"):
        self.shape, self.t, self.wl = shape, times, workload
        self.hw = times.hw
        self.act_b = dtype_bytes(act_dtype)

    def expert_split(self, g: int) -> tuple[int, int]:
        """(experts per device, expert TP): EP while g <= E, then TP inside each expert."""
        e = self.shape.num_experts
        if g <= e:
            if e % g:
                raise ConfigError(f"colocated group={g}: must divide num_experts={e}")
            return e // g, 1
        if g % e:
            raise ConfigError(f"colocated group={g}: must be a multiple of num_experts={e}")
        return 1, g // e

    def mem(self, plan: ColocatedPlan) -> float:
        s, g = self.shape, plan.group
        e_local, tp_e = self.expert_split(g)
        weights = s.attention_side_bytes(self.t.dtype) / g
        weights += e_local * s.num_layers * s.expert_bytes(self.t.dtype) / tp_e
        split = 1 if s.kv_elems_override else min(g, s.num_kv_heads)
        kv = plan.batch * self.wl.kv_len * s.num_layers * s.kv_elems / split * self.t.kvb
        return weights + kv

    def predict(self, plan: ColocatedPlan) -> ColocatedPrediction:
        s, g, m = self.shape, plan.group, plan.m
        b = plan.batch / m  # tokens per micro-batch in the group
        e_local, tp_e = self.expert_split(g)
        node = self.hw.node  # ranks sharing a CPU node (GPU profiles: no-op); all g compute at once
        t_a = (self.t.t_attn(b, self.wl.ctx_mean, g) + node.hop_overhead("attention", g)) \
            * node.dilation("attention", g)
        t_e = (self.t.t_expert([b * s.top_k / s.num_experts] * e_local, tp_e)
               + node.hop_overhead("expert", g)) * node.dilation("expert", g)
        a2a = b * s.top_k * s.hidden_size * self.act_b / g  # each device's share of the slots
        t_x = self.hw.intra_link.time(a2a, n_msgs=g - 1) + node.wake_latency_s if g > 1 else 0.0
        compute, comm = t_a + t_e, 2 * t_x
        t_layer = compute + comm if m == 1 else max(2 * compute, 2 * comm, compute + comm)
        t_iter = s.num_layers * t_layer + m * self.t.t_head(b, g)
        return ColocatedPrediction(plan, t_layer, t_iter, self.mem(plan), g * self.hw.price_per_hour)
