"""Which weights of a model are kept in a stored format (``model.quantization``); the module
that holds a quantised linear weight: ``quant_linear.QuantLinear``. Formats and compute paths:
``megainfer.kernels.weight_quant`` / ``cpu_qgemm``; loading into them: ``quant_load.py``.

Kept quantised: attention projections, dense MLPs, shared and routed experts; in the model
dtype: embeddings, ``lm_head``, norms, routers, ``shared_expert_gate`` and MLA's ``kv_b_proj``.
Parameter names stay Hugging Face's: ``X.weight`` holds the stored tensor, its scale beside it
(``X.weight_scale_inv`` fp8, ``X.weight_scale`` int8, ``X.weight_scale_zeros`` int4).
``apply_weight_format`` swaps these in on the meta model and refuses (``ConfigError`` naming
the weight) a shape or tensor-parallel slice the format cannot store, before any read.
docs/checkpoints.md, "Weight formats".
"""
from __future__ import annotations

from typing import Optional

from torch import nn

from megainfer.config import ConfigError
from megainfer.kernels.weight_quant import WeightFormat

from .moe import EXPERT_WEIGHTS, RoutedExperts
from .quant_linear import QuantLinear, scale_param, storage_param

QUANTISED_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj",
                     "kv_a_proj_with_mqa", "gate_proj", "up_proj", "down_proj")


def _check_shape(fmt: WeightFormat, name: str, N: int, K: int) -> None:
    why = fmt.shape_error(N, K)
    if why:
        raise ConfigError(f"model.quantization={fmt.name}: {name} [{N}, {K}] cannot be "
                          f"stored: {why}")


def _check_shard(fmt: WeightFormat, name: str, shard) -> None:
    """A TP slice of the full weight must fall on whole fp8 blocks (rows or columns) or int4
    groups (columns), so each rank stores exactly single mode's blocks."""
    if shard is None:
        return
    dim, sl, full = shard
    unit = {("fp8", 0): fmt.block[0], ("fp8", 1): fmt.block[1],
            ("int4", 1): fmt.group_size}.get((fmt.name, dim))
    if unit is None:
        return
    for edge in (sl.start, sl.stop):
        if edge % unit and edge != full:
            what = "rows" if dim == 0 else "input columns"
            kind = "block" if fmt.name == "fp8" else "group"
            raise ConfigError(
                f"deploy.attention_tp: {name} is split at {what} [{sl.start}, {sl.stop}) of "
                f"{full}, not on whole {unit}-wide {kind}s of model.quantization={fmt.name}; "
                f"use an attention_tp whose slices hold whole {kind}s")


def apply_weight_format(model: nn.Module, fmt: Optional[WeightFormat]) -> None:
    """Swap every kept-quantised linear and expert weight of ``model`` (on the meta device)
    for its stored form in ``fmt``; None leaves the model as built."""
    if fmt is None:
        return
    for mod_name, mod in list(model.named_modules()):
        for child, lin in list(mod.named_children()):
            if not isinstance(lin, nn.Linear) or child not in QUANTISED_LINEARS:
                continue
            name = f"{mod_name}.{child}.weight"
            _check_shape(fmt, name, lin.out_features, lin.in_features)
            shard = getattr(lin.weight, "tp_shard", None)
            _check_shard(fmt, name, shard)
            bshard = getattr(lin.bias, "tp_shard", None) if lin.bias is not None else None
            setattr(mod, child, QuantLinear(lin.in_features, lin.out_features,
                                            lin.bias is not None, fmt, shard, bshard))
        if isinstance(mod, RoutedExperts):
            _quantise_experts(mod, mod_name, fmt)


def _quantise_experts(ex: RoutedExperts, mod_name: str, fmt: WeightFormat) -> None:
    ex.weight_format, ex.logical_shapes = fmt, {}
    for name in EXPERT_WEIGHTS:
        E, N, K = getattr(ex, name).shape
        _check_shape(fmt, f"{mod_name}.{name}", N, K)
        ex.logical_shapes[name] = (E, N, K)
        setattr(ex, name, storage_param(fmt.storage_shape((E,), N, K), fmt.storage_dtype))
        ex.register_parameter(name + fmt.scale_name, scale_param(fmt, fmt.scale_shape((E,), N, K)))


def is_quantised(module: nn.Module) -> bool:
    return isinstance(module, QuantLinear) or (isinstance(module, RoutedExperts)
                                               and module.quantised)


def weight_format_for(quantization: Optional[str], group_size: int, checkpoint_quant=None
                      ) -> Optional[WeightFormat]:
    """``model.quantization`` and the checkpoint's own ``QuantConfig`` (fp8.py; None for a
    plain checkpoint or dummy weights) -> the format weights are kept in (None: model dtype).
    null keeps an FP8 checkpoint's blocks; fp8 keeps them too, or quantises a plain checkpoint
    to 128 x 128 e4m3 blocks; fp8_dequant dequantises into the model dtype (as before)."""
    if quantization in ("fp8_dequant",) or (quantization is None and checkpoint_quant is None):
        return None
    if quantization in (None, "fp8"):
        if checkpoint_quant is not None:
            return WeightFormat("fp8", block=tuple(checkpoint_quant.block),
                                fp8_dtype=checkpoint_quant.dtype)
        return WeightFormat("fp8")
    if quantization == "int8":
        return WeightFormat("int8")
    if quantization == "int4":
        return WeightFormat("int4", group_size=group_size)
    raise ConfigError(f"model.quantization={quantization!r}: unknown weight format")
