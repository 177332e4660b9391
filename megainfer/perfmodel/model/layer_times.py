"""Per-layer compute times T_a (attention side) and T_e (expert side), in seconds.

Two sources, one interface:
  RooflineTimes  max(FLOPs / achieved FLOP/s, bytes / achieved bandwidth) from a datasheet profile
  FittedTimes    the calibrated linear fits T_a = k1*b_a + k2, T_e = k3*b_e + k4 of this machine
Both add the TP all-reduce over the intra-node link when tp > 1.

Weights are read in the shape's ``quantization`` (``ModelShape.attention_layer_bytes``,
``expert_bytes``); with ``fp8`` on a profile that lists ``matmul_flops.fp8`` the quantised
matmuls run at that rate (w8a8 block FP8), the other formats at the model dtype's (weight-only).
"""
from __future__ import annotations

from megainfer.config import ConfigError
from megainfer.perfmodel.model.hardware import HardwareProfile, LayerFit
from megainfer.perfmodel.model.shapes import ModelShape, dtype_bytes


def allreduce_time(hw: HardwareProfile, nbytes: float, tp: int) -> float:
    """Ring all-reduce of ``nbytes`` over ``tp`` ranks on the intra-node link."""
    if tp <= 1 or nbytes <= 0:
        return 0.0
    moved = 2.0 * (tp - 1) / tp * nbytes
    return 2 * (tp - 1) * hw.intra_link.latency_s + moved / (
        hw.intra_link.bandwidth_Bps * hw.intra_link.utilisation(nbytes / tp))


class RooflineTimes:
    """T_a, T_e from FLOPs and bytes moved; achieved rates = peak * efficiency."""

    kind = "roofline"

    def __init__(self, hw: HardwareProfile, shape: ModelShape, dtype: str = "bfloat16",
                 kv_dtype: str | None = None):
        self.hw, self.shape, self.dtype = hw, shape, dtype
        self.wb = dtype_bytes(dtype)
        # bytes per cached KV element: shape.kv_cache_dtype (auto: dtype's), unless kv_dtype
        self.kvb = dtype_bytes(kv_dtype) if kv_dtype else shape.kv_elem_bytes(dtype)
        self.flops = hw.flops(dtype) * hw.matmul_efficiency
        fp8 = shape.quantization == "fp8" and "fp8" in hw.matmul_flops
        # the quantised matmuls' FLOPs as model-dtype FLOPs (fp8 tensor cores: fewer)
        self.qflop_scale = hw.flops(dtype) / hw.flops("fp8") if fp8 else 1.0
        self.bw = hw.mem_bw_Bps * hw.mem_efficiency

    def _roof(self, flops: float, nbytes: float) -> float:
        return max(flops / self.flops, nbytes / self.bw) + self.hw.kernel_overhead_s

    def t_attn(self, b: float, ctx: float, tp: int = 1) -> float:
        """One layer, one micro-batch of ``b`` decode tokens with mean context ``ctx``, one replica."""
        if b <= 0:
            return 0.0
        s, h = self.shape, self.shape.hidden_size
        dense = s.attn_params + s.shared_params  # TP-split matmuls
        quant = dense - s.attn_unquantised_params  # of which in the stored format
        flops = 2 * b * (quant * self.qflop_scale + s.attn_unquantised_params) / tp
        flops += 2 * b * s.router_params  # projections (+shared), router
        flops += 4 * b * ctx * s.num_heads * s.head_dim / tp  # q.k^T and p.v
        kv_per_rank = s.kv_elems / min(tp, s.num_kv_heads) if not s.kv_elems_override else s.kv_elems
        dense_b, router_b = s.attention_layer_bytes(self.dtype)
        nbytes = dense_b / tp + router_b  # weights read once
        nbytes += b * ctx * kv_per_rank * self.kvb  # KV cache read
        nbytes += 6 * b * h * self.wb  # activations in/out (small)
        return self._roof(flops, nbytes) + allreduce_time(self.hw, b * h * self.wb, tp)

    def t_expert(self, tokens_per_expert, tp: int = 1) -> float:
        """One layer, one micro-batch on one expert rank holding len(tokens_per_expert) experts."""
        s = self.shape
        active = [t for t in tokens_per_expert if t > 0]
        if not active:
            return 0.0
        tokens = float(sum(active))
        flops = 2 * tokens * s.expert_params * self.qflop_scale / tp
        nbytes = len(active) * s.expert_bytes(self.dtype) / tp
        nbytes += tokens * (2 * s.hidden_size + 2 * s.moe_intermediate_size / tp) * self.wb
        return self._roof(flops, nbytes) + allreduce_time(self.hw, tokens * s.hidden_size * self.wb, tp)

    def t_head(self, b: float, tp: int = 1) -> float:
        """lm_head + final norm for ``b`` tokens once per iteration (not part of T_total)."""
        if b <= 0:
            return 0.0
        p = self.shape.vocab_size * self.shape.hidden_size
        return self._roof(2 * b * p / tp, p * self.wb / tp)


class FittedTimes(RooflineTimes):
    """Calibrated fits for this exact model shape; TP splits the per-token slope. The context
    slope k1_ctx is as measured (with a model-dtype cache): a low-bit ``kv_cache_dtype`` changes
    the KV memory (``kvb``), not the fitted time."""

    kind = "fitted"

    def __init__(self, hw: HardwareProfile, shape: ModelShape, fit: LayerFit):
        super().__init__(hw, shape, dtype=fit.dtype)
        self.fit = fit

    def t_attn(self, b: float, ctx: float, tp: int = 1) -> float:
        if b <= 0:
            return 0.0
        f = self.fit
        return (f.k2 + b * (f.k1 + f.k1_ctx * ctx) / tp
                + allreduce_time(self.hw, b * self.shape.hidden_size * self.wb, tp))

    def t_expert(self, tokens_per_expert, tp: int = 1) -> float:
        f = self.fit
        t = sum(f.k4 + f.k3 * n / tp for n in tokens_per_expert if n > 0)
        tokens = sum(tokens_per_expert)
        return t + allreduce_time(self.hw, tokens * self.shape.hidden_size * self.wb, tp)


def layer_times_for(hw: HardwareProfile, shape: ModelShape, dtype: str = "bfloat16",
                    use_fit: bool = True) -> RooflineTimes:
    """The calibrated fit for this model on this hardware if there is one, else the roofline."""
    if use_fit and shape.name in hw.fits:
        return FittedTimes(hw, shape, hw.fits[shape.name])
    if dtype not in hw.matmul_flops:
        raise ConfigError(f"hardware[{hw.name}] has no matmul_flops for dtype={dtype!r} "
                          f"and no calibrated fit for model {shape.name!r}")
    return RooflineTimes(hw, shape, dtype)


def linear_fit_of(times: RooflineTimes, ctx: float, sizes=(8, 16, 32, 64, 128, 256)) -> LayerFit:
    """k1..k4 by least squares over ``sizes`` (for Algorithm 1's balance estimate n_a)."""
    from megainfer.perfmodel.model.fit import fit_line
    k1, k2 = fit_line(sizes, [times.t_attn(b, ctx) for b in sizes])
    k3, k4 = fit_line(sizes, [times.t_expert([b]) for b in sizes])
    return LayerFit(k1=k1, k2=k2, k3=k3, k4=k4, ctx_ref=int(ctx), dtype=times.dtype)
