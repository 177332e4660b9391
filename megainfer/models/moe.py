"""The MoE block, split the way the runtime drives it.

* ``Router`` (attention side): logits -> top-k expert ids and weights, exactly as HF does it.
* ``RoutedExperts`` (expert side, "the expert half"): the grouped FFN over the expert slots
  this process holds, ``gate_up_proj [E_local, 2N, H]`` and ``down_proj [E_local, H, N]``
  (HF transformers 5 fused layout), with ``expert_map`` from physical slot id to local index.
* shared expert (Qwen2-MoE, sigmoid-gated): its own piece, placed on the attention side.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from megainfer.kernels import cpu_gemm, fused_moe, select_experts

from megainfer.kernels.weight_quant import QuantizedWeight, WeightFormat

from .layers import GatedMLP

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


class Router(nn.Module):
    """gate.weight [E, H]. softmax (fp32) -> top-k -> optional renormalisation (HF semantics)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, renormalize: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.top_k, self.renormalize = top_k, renormalize

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> topk_weights [T, k] (x's dtype), topk_ids [T, k] int64."""
        logits = F.linear(x, self.weight)  # [T, E]
        w, ids = select_experts(logits, self.top_k, scoring="softmax", renormalize=self.renormalize)
        return w.to(x.dtype), ids


class SigmoidRouter(nn.Module):
    """DeepSeek-V3 ``mlp.gate``: weight [E, H] and e_score_correction_bias [E], both kept in
    float32 (``keep_fp32``: the loader does not cast them). Logits in fp32 as HF; sigmoid
    scores, choice by score + bias within the top ``topk_group`` of ``n_group`` groups,
    weights = unbiased scores (renormalised with norm_topk_prob) * routed_scaling_factor."""

    def __init__(self, cfg):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.empty(cfg.num_experts))
        self.weight.keep_fp32 = self.e_score_correction_bias.keep_fp32 = True
        self.top_k, self.renormalize = cfg.top_k, cfg.norm_topk_prob
        self.groups, self.topk_groups = cfg.n_group, cfg.topk_group
        self.scaling = cfg.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> topk_weights [T, k] (x's dtype), topk_ids [T, k] int64."""
        logits = F.linear(x.float(), self.weight.float())  # [T, E] fp32
        w, ids = select_experts(logits, self.top_k, scoring="sigmoid", renormalize=self.renormalize,
                                correction_bias=self.e_score_correction_bias,
                                num_groups=self.groups, topk_groups=self.topk_groups,
                                routed_scaling_factor=self.scaling)
        return w.to(x.dtype), ids


class SoftmaxGroupRouter(nn.Module):
    """DeepSeek-V2 ``mlp.gate`` (HF ``DeepseekV2TopkRouter``): weight [E, H] kept float32, fp32
    logits, softmax; ``group_limited_greedy`` (n_group > 1) zeroes all but the topk_group
    groups with the largest max score; top-k unsorted, no renormalisation; * scaling."""

    def __init__(self, cfg):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        self.weight.keep_fp32 = True
        self.top_k, self.groups, self.topk_groups = cfg.top_k, cfg.n_group, cfg.topk_group
        self.scaling = cfg.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> topk_weights [T, k] (x's dtype), topk_ids [T, k] int64."""
        scores = F.linear(x.float(), self.weight.float()).softmax(dim=-1)  # [T, E] fp32
        if self.groups > 1:
            T, E = scores.shape
            best = scores.view(T, self.groups, E // self.groups).max(dim=-1).values  # [T, G]
            keep = torch.zeros_like(best).scatter_(
                1, torch.topk(best, k=self.topk_groups, dim=-1, sorted=False)[1], 1)
            mask = keep.unsqueeze(-1).expand(-1, -1, E // self.groups).reshape(T, E)
            scores = scores.masked_fill(~mask.bool(), 0.0)
        w, ids = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)  # [T, k]
        return (w * self.scaling).to(x.dtype), ids


class RoutedExperts(nn.Module):
    """The expert half: ``slots`` lists the physical expert slots held here (local order)."""

    def __init__(self, hidden: int, inter: int, num_slots: int, slots: Sequence[int]):
        super().__init__()
        n = len(slots)
        self.gate_up_proj = nn.Parameter(torch.empty(n, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(n, hidden, inter))
        emap = torch.full((num_slots,), -1, dtype=torch.int32)
        emap[torch.tensor(list(slots), dtype=torch.long)] = torch.arange(n, dtype=torch.int32)
        self.register_buffer("expert_map", emap, persistent=False)  # [num_slots] -> local or -1
        self.slots = list(slots)
        self.identity = self.slots == list(range(num_slots))  # every slot here, in order
        self.compute_dtype: Optional[torch.dtype] = None  # the model dtype (set by the loader)
        # model.quantization's stored format (quant_weights.apply_weight_format sets it, with
        # each weight's logical [E_local, N, K]); None: the weights are plain tensors
        self.weight_format: Optional[WeightFormat] = None
        self.logical_shapes: dict[str, tuple] = {}

    @property
    def quantised(self) -> bool:
        return self.weight_format is not None

    def stored(self, name: str):
        """``gate_up_proj`` / ``down_proj`` as the GEMM takes it: the tensor itself, or a
        ``QuantizedWeight`` [E_local, N, K] over the stored tensor and its scale."""
        w = getattr(self, name)
        fmt = self.weight_format
        if fmt is None:
            return w
        return QuantizedWeight(w, getattr(self, name + fmt.scale_name), fmt,
                               self.logical_shapes[name])

    def slot_tensors(self, slot: int) -> list:
        """Every stored tensor of one local slot, in the order a weight move sends them:
        gate_up, down, then (quantised experts) their scales."""
        out = [self.gate_up_proj.data[slot], self.down_proj.data[slot]]
        if self.weight_format is not None:
            out += [getattr(self, n + self.weight_format.scale_name).data[slot]
                    for n in EXPERT_WEIGHTS]
        return out

    def init_buffers(self, device) -> None:
        """Rebuild expert_map (int32) on device: the loader builds the model on the meta device,
        where buffers hold no values."""
        emap = torch.full((self.expert_map.shape[0],), -1, dtype=torch.int32, device="cpu")
        emap[torch.tensor(self.slots, dtype=torch.long, device="cpu")] = torch.arange(
            len(self.slots), dtype=torch.int32, device="cpu")
        self.expert_map = emap.to(device)

    def slot_written(self, local: int) -> None:
        """Local slot ``local``'s weights were overwritten in place (through ``.data``, as EPLB
        and re-plan moves do): its GEMM layouts are rebuilt on the next call."""
        cpu_gemm.forget_packed(self.gate_up_proj, local)
        cpu_gemm.forget_packed(self.down_proj, local)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor):
        """x [T, H], topk_* [T, k] (physical slot ids) -> partial sum [T, H] over local slots."""
        emap = None if self.identity else self.expert_map
        return fused_moe(x, self.stored("gate_up_proj"), self.stored("down_proj"),
                         topk_weights, topk_ids, emap)

    def empty_output(self) -> torch.Tensor:
        """The [0, H] partial sum of a micro-batch with no tokens, in the model dtype on the
        experts' device (the weights' own dtype may be a stored format's)."""
        dp = self.down_proj
        return torch.empty(0, dp.shape[1], dtype=self.compute_dtype or dp.dtype, device=dp.device)


class MoEBlock(nn.Module):
    """mlp of an MoE layer: gate (router), experts (expert half), optional shared expert:
    sigmoid-gated ``shared_expert`` (Qwen2-MoE) or ungated ``shared_experts`` (DeepSeek-V3)."""

    def __init__(self, cfg, expert_slots: Optional[Sequence[int]], num_slots: int):
        super().__init__()
        if cfg.scoring == "sigmoid":
            self.gate = SigmoidRouter(cfg)
        elif cfg.family == "deepseek_v2":
            self.gate = SoftmaxGroupRouter(cfg)
        else:
            self.gate = Router(cfg.hidden_size, cfg.num_experts, cfg.top_k, cfg.norm_topk_prob)
        slots = range(num_slots) if expert_slots is None else expert_slots
        self.experts = RoutedExperts(cfg.hidden_size, cfg.moe_intermediate_size, num_slots, slots)
        if cfg.n_shared_experts:
            self.shared_experts = GatedMLP(cfg.hidden_size,
                                           cfg.n_shared_experts * cfg.moe_intermediate_size)
        elif cfg.shared_expert_intermediate_size:
            self.shared_expert = GatedMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def shared(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """x [T, H] -> sigmoid(gate(x)) * shared_expert(x) or shared_experts(x) [T, H], or None."""
        if hasattr(self, "shared_experts"):
            return self.shared_experts(x)
        if not hasattr(self, "shared_expert"):
            return None
        return torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Everything local (single mode): routed experts + shared expert."""
        w, ids = self.gate(x)
        out = self.experts(x, w, ids)
        shared = self.shared(x)
        return out if shared is None else out + shared
