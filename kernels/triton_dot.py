"""The one matmul-accumulate every Triton kernel here uses, with the interpreter's workaround."""
import torch
import triton
import triton.language as tl

from .tile_configs import interpreting


@triton.jit
def dot(a, b, acc, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """acc + a @ b. IEEE: fp32 without TF32. UPCAST: bf16/fp16 -> fp32 first (the interpreter's
    bf16 tl.dot returns garbage in triton 3.7, so tests run the fp32 dot on bf16 data)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


def dot_flags(dtype: torch.dtype) -> dict:
    """``dot``'s constexprs for inputs of ``dtype``: IEEE for fp32 (no TF32) and whenever the
    interpreter runs (it computes in fp32); UPCAST bf16/fp16 data there."""
    up = interpreting()
    return dict(IEEE=dtype == torch.float32 or up, UPCAST=up and dtype != torch.float32)
