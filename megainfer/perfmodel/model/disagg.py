"""One deployment plan -> predicted T_a, T_e, T_c, iteration time, memory and throughput."""
from __future__ import annotations

from dataclasses import dataclass, replace

from megainfer.config import ConfigError
from megainfer.perfmodel.model.hardware import HardwareProfile
from megainfer.perfmodel.model.layer_times import RooflineTimes
from megainfer.perfmodel.model.pipeline import micro_batch_sizes, t_total
from megainfer.perfmodel.model.shapes import ModelShape, dtype_bytes


@dataclass(frozen=True)
class Workload:
    input_len: int = 1024
    output_len: int = 512

    def __post_init__(self):
        for n in ("input_len", "output_len"):
            v = getattr(self, n)
            if not (isinstance(v, int) and v > 0):
                raise ConfigError(f"workload.{n}={v!r}: must be a positive integer")

    @property
    def ctx_mean(self) -> float:
        """Mean context length a decode step attends over."""
        return self.input_len + self.output_len / 2

    @property
    def kv_len(self) -> int:
        """KV slots a sequence holds at its longest."""
        return self.input_len + self.output_len


@dataclass(frozen=True)
class Plan:
    """Disaggregated plan: n_a attention replicas of tp_a devices, n_e expert ranks of tp_e."""

    tp_a: int
    n_a: int
    tp_e: int
    n_e: int
    m: int
    batch: int  # global batch B: sequences decoding in one iteration, all replicas
    hw_a: str = ""
    hw_e: str = ""
    ranks_per_node: int = 0  # 0: all of the plan's ranks on one node (matters only on shared nodes)

    def __post_init__(self):
        if not (isinstance(self.ranks_per_node, int) and self.ranks_per_node >= 0):
            raise ConfigError(f"plan.ranks_per_node={self.ranks_per_node!r}: must be an integer >= 0")
        for n in ("tp_a", "n_a", "tp_e", "n_e", "m"):
            v = getattr(self, n)
            if not (isinstance(v, int) and v >= 1):
                raise ConfigError(f"plan.{n}={v!r}: must be an integer >= 1")
        if not (isinstance(self.batch, int) and self.batch >= 0):
            raise ConfigError(f"plan.batch={self.batch!r}: must be an integer >= 0")

    @property
    def devices(self) -> int:
        return self.n_a * self.tp_a + self.n_e * self.tp_e

    def label(self) -> str:
        a = f"A{self.n_a}x tp{self.tp_a}" + (f"[{self.hw_a}]" if self.hw_a else "")
        e = f"E{self.n_e}x tp{self.tp_e}" + (f"[{self.hw_e}]" if self.hw_e else "")
        return f"{a} + {e}"


@dataclass(frozen=True)
class Prediction:
    plan: Plan
    t_a: float
    t_e: float
    t_c: float
    t_total: float  # T_total: all MoE layers, all micro-batches
    t_head: float  # lm_head per iteration (m micro-batches)
    mem_attn: float  # bytes per attention device
    mem_expert: float  # bytes per expert device
    cost_per_hour: float

    @property
    def t_iter(self) -> float:
        """Decode iteration = per-token latency (TPOT) of every sequence in the batch."""
        return self.t_total + self.t_head

    @property
    def tokens_per_s(self) -> float:
        return self.plan.batch / self.t_iter if self.t_iter > 0 else 0.0

    @property
    def tokens_per_s_per_device(self) -> float:
        return self.tokens_per_s / self.plan.devices

    @property
    def tokens_per_dollar(self) -> float:
        return self.tokens_per_s * 3600 / self.cost_per_hour if self.cost_per_hour > 0 else float("inf")


class DisaggModel:
    """Evaluates plans for one model on attention hardware ``hw_a`` and expert hardware ``hw_e``."""

    def __init__(self, shape: ModelShape, times_a: RooflineTimes, times_e: RooflineTimes,
                 workload: Workload, act_dtype: str = "bfloat16"):
        self.shape, self.ta, self.te, self.wl = shape, times_a, times_e, workload
        self.hw_a: HardwareProfile = times_a.hw
        self.hw_e: HardwareProfile = times_e.hw
        self.act_b = dtype_bytes(act_dtype)

    def experts_per_rank(self, n_e: int) -> int:
        if self.shape.num_experts % n_e:
            raise ConfigError(f"plan.n_e={n_e}: must divide num_experts={self.shape.num_experts}")
        return self.shape.num_experts // n_e

    def t_comm(self, b_a: float, b_e: float, plan: Plan) -> float:
        """One-way A2E (= E2A) time of one micro-batch: the slower of a sender and a receiver,
        plus the node's wake-up latency (a waiting receiver notices the message that late)."""
        h, k = self.shape.hidden_size, self.shape.top_k
        sent = b_a * k * h * self.act_b  # one replica's token slots, spread over its tp_a NICs
        recv = b_e * self.experts_per_rank(plan.n_e) * h * self.act_b
        t_send = self.hw_a.inter_link.time(sent / plan.tp_a, n_msgs=plan.n_e)
        t_recv = self.hw_e.inter_link.time(recv / plan.tp_e, n_msgs=plan.n_a)
        wake = max(self.hw_a.node.wake_latency_s, self.hw_e.node.wake_latency_s)  # receiver polls
        return max(t_send, t_recv) + wake

    def node_terms(self, plan: Plan, t_a0: float, t_e0: float) -> tuple[float, float, float, float]:
        """(host overhead_a, host overhead_e, dilation_a, dilation_e) of ranks sharing a node.

        Per (layer, micro-batch) each side adds its host overhead (``NodeProfile.hop_overhead``,
        peers = the other side's ranks). Its compute is then stretched by ``NodeProfile.dilation``
        of the ranks computing at the same time on its node: its own side's ranks always (the
        replicas, resp. the expert ranks, run in lock step), plus the other side's for the
        fraction phi of its time that they overlap. With m = 1 the sides alternate (phi = 0);
        with m >= 2 attention of micro-batch i+1 runs while the experts run micro-batch i, so
        phi_a = min(1, T_e / T_a), phi_e = min(1, T_a / T_e). Both sides share a node only
        when they run on the same hardware profile; ``plan.ranks_per_node`` < all ranks puts
        that share of each side's ranks on a node. A side with TP > 1 also waits once per
        (layer, micro-batch) for its all-reduce, noticed ``node.wake_latency_s`` late (added
        as wake / d to its overhead, so it is not stretched). Profiles with node.cores = 0
        (one GPU per rank) give (0, 0, 1, 1): no sharing.
        """
        na_, ne_ = self.hw_a.node, self.hw_e.node
        h_a = na_.hop_overhead("attention", plan.n_e)
        h_e = ne_.hop_overhead("expert", plan.n_a)
        ranks = plan.devices
        share = min(1.0, plan.ranks_per_node / ranks) if plan.ranks_per_node else 1.0
        same = self.hw_a is self.hw_e or self.hw_a.name == self.hw_e.name
        own_a, own_e = plan.n_a * plan.tp_a * share, plan.n_e * plan.tp_e * share
        ta, te = t_a0 + h_a, t_e0 + h_e
        phi_a = min(1.0, te / ta) if plan.m > 1 and same and ta > 0 else 0.0
        phi_e = min(1.0, ta / te) if plan.m > 1 and same and te > 0 else 0.0
        d_a = (1 - phi_a) * na_.dilation("attention", own_a) + phi_a * na_.dilation("attention", own_a + own_e)
        d_e = (1 - phi_e) * ne_.dilation("expert", own_e) + phi_e * ne_.dilation("expert", own_a + own_e)
        # a TP group's all-reduce (one per layer and micro-batch) is a wait for the peers' parts,
        # noticed node.wake_latency_s late like any message: a wait, so not stretched by d
        if plan.tp_a > 1 and na_.cores > 0:
            h_a += na_.wake_latency_s / d_a
        if plan.tp_e > 1 and ne_.cores > 0:
            h_e += ne_.wake_latency_s / d_e
        return h_a, h_e, d_a, d_e

    def plan_node_terms(self, plan: Plan) -> tuple[float, float, float, float]:
        """``node_terms`` at the plan's balanced load: what ``stage_fns`` adds to the fits."""
        s = self.shape
        b_a, b_e = micro_batch_sizes(plan.batch, plan.m, plan.n_a, s.num_experts, s.top_k)
        t_a0 = self.ta.t_attn(b_a, self.wl.ctx_mean, plan.tp_a)
        t_e0 = self.te.t_expert([b_e] * self.experts_per_rank(plan.n_e), plan.tp_e)
        return self.node_terms(plan, t_a0, t_e0)

    def stage_fns(self, plan: Plan):
        """(t_attn(b_a), t_expert(tokens per local expert), t_comm) as the pipeline sees them:
        per-layer kernel fits plus the node terms, fixed for this plan at its balanced load."""
        s = self.shape
        b_a, b_e = micro_batch_sizes(plan.batch, plan.m, plan.n_a, s.num_experts, s.top_k)
        ctx = self.wl.ctx_mean
        h_a, h_e, d_a, d_e = self.plan_node_terms(plan)

        def t_attn(b):
            return (self.ta.t_attn(b, ctx, plan.tp_a) + h_a) * d_a if b > 0 else 0.0

        def t_expert(counts):
            t = self.te.t_expert(list(counts), plan.tp_e)
            return (t + h_e) * d_e if t > 0 else 0.0
        return t_attn, t_expert, self.t_comm(b_a, b_e, plan)

    def mem_attention(self, plan: Plan) -> float:
        s = self.shape
        weights = s.attention_side_bytes(self.ta.dtype) / plan.tp_a
        kv_heads_split = 1 if s.kv_elems_override else min(plan.tp_a, s.num_kv_heads)
        kv_per_seq = self.wl.kv_len * s.num_layers * s.kv_elems / kv_heads_split * self.ta.kvb
        return weights + kv_per_seq * plan.batch / plan.n_a

    def attention_seqs(self, plan: Plan, cap: float) -> tuple[int, float, float]:
        """(sequences per attention replica that ``cap`` bytes hold beside the weights, the
        weights' bytes, one more sequence's bytes) for ``plan``'s split (its batch unused)."""
        w = self.mem_attention(replace(plan, batch=0))
        per_seq = self.mem_attention(replace(plan, batch=plan.n_a)) - w
        return (int((cap - w) // per_seq) if cap > w and per_seq > 0 else 0), w, per_seq

    def mem_expert(self, plan: Plan) -> float:
        s = self.shape
        return self.experts_per_rank(plan.n_e) * s.num_layers * s.expert_bytes(self.te.dtype) / plan.tp_e

    def predict(self, plan: Plan) -> Prediction:
        s = self.shape
        b_a, b_e = micro_batch_sizes(plan.batch, plan.m, plan.n_a, s.num_experts, s.top_k)
        f_a, f_e, t_c = self.stage_fns(plan)
        t_a, t_e = f_a(b_a), f_e([b_e] * self.experts_per_rank(plan.n_e))
        tt = t_total(t_a, t_e, t_c, plan.m, s.num_layers)
        t_head = plan.m * self.ta.t_head(b_a, plan.tp_a)
        cost = (plan.n_a * plan.tp_a * self.hw_a.price_per_hour
                + plan.n_e * plan.tp_e * self.hw_e.price_per_hour)
        return Prediction(plan, t_a, t_e, t_c, tt, t_head, self.mem_attention(plan),
                          self.mem_expert(plan), cost)
