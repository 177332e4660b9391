"""The module that holds one quantised linear weight (``QuantLinear``, ``model.quantization``)
and the parameters a stored format allocates (``storage_param``, ``scale_param``); which
weights get them: ``quant_weights.py``.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from megainfer.kernels.cpu_qgemm import qlinear
from megainfer.kernels.weight_quant import QuantizedWeight, WeightFormat


def storage_param(shape, dtype, *, keep_fp32=False) -> nn.Parameter:
    """A parameter the loader allocates in its own dtype (``quant_storage``) or float32."""
    p = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    if keep_fp32:
        p.keep_fp32 = True
    else:
        p.quant_storage = True
    return p


def scale_param(fmt: WeightFormat, shape) -> nn.Parameter:
    """fp8 block scales: float32 (as shipped); int8/int4 scales: the model dtype (the CPU ops
    take them in the activations' dtype), so allocated like any other parameter."""
    if fmt.name == "fp8":
        return storage_param(shape, torch.float32, keep_fp32=True)
    return nn.Parameter(torch.empty(shape), requires_grad=False)


class QuantLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W [out, in]`` kept in ``fmt``: ``weight`` (the stored tensor)
    and ``weight<fmt.scale_name>``; ``bias`` in the model dtype. ``shard``: (dim, slice of the
    full logical weight this rank holds, full size), nn.Linear's ``tp_shard``."""

    def __init__(self, in_features: int, out_features: int, bias: bool, fmt: WeightFormat,
                 shard: Optional[tuple] = None, bias_shard: Optional[tuple] = None):
        super().__init__()
        self.in_features, self.out_features, self.fmt, self.shard = (in_features, out_features,
                                                                     fmt, shard)
        N, K = out_features, in_features
        self.weight = storage_param(fmt.storage_shape((), N, K), fmt.storage_dtype)
        self.register_parameter("weight" + fmt.scale_name,
                                scale_param(fmt, fmt.scale_shape((), N, K)))
        self.bias = nn.Parameter(torch.empty(N)) if bias else None
        if bias and bias_shard is not None:
            self.bias.tp_shard = bias_shard

    @property
    def full_shape(self) -> tuple:
        """The logical [out, in] of the whole checkpoint tensor this rank holds a slice of."""
        shape = [self.out_features, self.in_features]
        if self.shard is not None:
            shape[self.shard[0]] = self.shard[2]
        return tuple(shape)

    @property
    def scale(self) -> torch.Tensor:
        return getattr(self, "weight" + self.fmt.scale_name)

    @property
    def qweight(self) -> QuantizedWeight:
        return QuantizedWeight(self.weight, self.scale, self.fmt,
                               (self.out_features, self.in_features))

    def forward(self, x: torch.Tensor, with_bias: bool = True) -> torch.Tensor:
        """x [..., in] -> [..., out] in x's dtype (``with_bias=False``: a row-parallel
        partial sum, the bias added after the all-reduce)."""
        return qlinear(x, self.qweight, self.bias if with_bias else None)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, format={self.fmt.name}"
