"""The FP8 block dequantiser (``models/fp8.py``) against a per-element loop, its shape and value
checks, and the ``quantization_config`` it reads (DeepSeek-V3 / HF ``quant_method: fp8``).
Loading whole checkpoints: tests/unit/models/test_fp8_checkpoint.py (which shares the helpers here)."""
import pytest
import torch

from megainfer.config import ConfigError
from megainfer.models.checkpoint_reader import CorruptCheckpointError, ShapeMismatchError
from megainfer.models.fp8 import QuantConfig, check_scale_values, dequantize_blockwise

BLOCK = (32, 32)
QCFG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": list(BLOCK)}
E4M3_MAX = 448.0


def _cdiv(a, b):
    return -(-a // b)


def _naive(w, s, block, row0=0):
    """Per element, in Python: float32 w[i, j] times its block's scale (the product of two
    float32 values is exact in a double, so rounding it once to float32 is float32's product)."""
    bo, bi = block
    wl, sl = w.float().tolist(), s.float().tolist()
    out = [[wl[i][j] * sl[(row0 + i) // bo - row0 // bo][j // bi] for j in range(len(wl[i]))]
           for i in range(len(wl))]
    return torch.tensor(out, dtype=torch.float32).reshape(w.shape)


def _quantize(w, block, dtype=torch.float8_e4m3fn, fmax=E4M3_MAX):
    """w [..., R, C] -> (float8 [..., R, C], float32 scale_inv [..., ceil(R/bo), ceil(C/bi)])
    with scale_inv = block amax / fmax."""
    bo, bi = block
    *lead, R, C = w.shape
    nr, nc = _cdiv(R, bo), _cdiv(C, bi)
    pad = torch.zeros(*lead, nr * bo, nc * bi)
    pad[..., :R, :C] = w
    blocks = pad.unflatten(-1, (nc, bi)).unflatten(-3, (nr, bo))  # [..., nr, bo, nc, bi]
    scale = (blocks.abs().amax(dim=(-3, -1)) / fmax).clamp_min(1e-12)  # [..., nr, nc]
    q = (blocks / scale[..., :, None, :, None]).clamp(-fmax, fmax).to(dtype)
    q = q.flatten(-2, -1).flatten(-3, -2)[..., :R, :C].contiguous()
    return q, scale.float().contiguous()


def _random_fp8(shape, seed, dtype=torch.float8_e4m3fn):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 50).to(dtype)


def _random_scale(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(shape, generator=g) * 0.01 + 1e-4


# ----------------------------------------------------------------------------- dequantiser
@pytest.mark.parametrize("shape,block", [((576, 200), (128, 128)), ((576, 7168 // 32), (128, 64)),
                                         ((48, 72), (32, 32)), ((70, 33), (16, 8)),
                                         ((5, 7), (16, 16)), ((64, 64), (32, 32))])
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_dequantize_matches_naive_loop(shape, block, fp8):
    w = _random_fp8(shape, 1, fp8)
    s = _random_scale((_cdiv(shape[0], block[0]), _cdiv(shape[1], block[1])), 2)
    got = dequantize_blockwise(w, s, block)
    assert got.dtype == torch.float32 and got.shape == w.shape
    assert torch.equal(got, _naive(w, s, block))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dequantize_casts_once_from_float32(dtype):
    w, s = _random_fp8((72, 48), 3), _random_scale((3, 2), 4)
    got = dequantize_blockwise(w, s, BLOCK, dtype)
    assert got.dtype == dtype and torch.equal(got, _naive(w, s, BLOCK).to(dtype))


@pytest.mark.parametrize("r0,r1", [(0, 72), (24, 72), (32, 64), (5, 9), (31, 33), (40, 72),
                                   (64, 72), (7, 7)])
def test_dequantize_row_slice_off_block_boundary(r0, r1):
    w, s = _random_fp8((72, 48), 5), _random_scale((3, 2), 6)
    full = _naive(w, s, BLOCK)
    sl = s[r0 // 32:_cdiv(r1, 32)]
    assert torch.equal(dequantize_blockwise(w[r0:r1], sl, BLOCK, row0=r0), full[r0:r1])
    assert torch.equal(_naive(w[r0:r1], sl, BLOCK, row0=r0), full[r0:r1])


def test_dequantize_fused_3d():
    w, s = _random_fp8((3, 144, 48), 7), _random_scale((3, 5, 2), 8)
    got = dequantize_blockwise(w, s, BLOCK)
    for e in range(3):
        assert torch.equal(got[e], _naive(w[e], s[e], BLOCK))


@pytest.mark.parametrize("sshape", [(2, 2), (3, 1), (3, 3), (6,), (1, 3, 2)])
def test_misshaped_scale_is_a_shape_error(sshape):
    with pytest.raises(ShapeMismatchError, match=r"layers\.0\.q_proj\.weight.*\[3, 2\]"):
        dequantize_blockwise(_random_fp8((72, 48), 1), torch.ones(sshape), BLOCK,
                             name="layers.0.q_proj.weight")


@pytest.mark.parametrize("bad", [float("nan"), 0.0, -1.0, float("inf")])
def test_bad_scale_values_are_corrupt(bad):
    s = torch.ones(3, 2)
    s[1, 1] = bad
    with pytest.raises(CorruptCheckpointError, match=r"x\.weight_scale_inv.*block \[1, 1\]"):
        check_scale_values("x.weight_scale_inv", s)


def test_quant_config_parsing():
    q = QuantConfig.from_hf({"quantization_config": dict(QCFG, weight_block_size=[64, 16])})
    assert (q.fmt, q.block, q.dtype) == ("e4m3", (64, 16), torch.float8_e4m3fn)
    assert QuantConfig.from_hf({"quantization_config": dict(QCFG, fmt="e5m2")}).dtype == \
        torch.float8_e5m2
    assert QuantConfig.from_hf({"model_type": "mixtral"}) is None


@pytest.mark.parametrize("key,value", [("quant_method", "gptq"), ("quant_method", None),
                                       ("fmt", "e3m4"), ("weight_block_size", [128]),
                                       ("weight_block_size", None), ("weight_block_size", [0, 128]),
                                       ("activation_scheme", "static")])
def test_quant_config_rejects(key, value):
    cfg = {"quantization_config": dict(QCFG, **{key: value})}
    with pytest.raises(ConfigError, match=rf"config\.json quantization_config\.{key}="):
        QuantConfig.from_hf(cfg)
