"""Low-bit KV formats (cache.kv_cache_dtype, ``megainfer.kernels.kv_quant``): round trips of
random, adversarial and wide-ranged values, per layer (``tensor``) and per row (``token_head``:
every stored row carries its own scale inline, so its bytes depend on that row alone), and the
stored row layouts."""
import pytest
import torch
from kv_quant_util import QUANT, RT_BOUND, TH, rel_error

from megainfer.kernels import kv_fp4, kv_quant


@pytest.mark.parametrize("fmt", QUANT)
def test_round_trip_random(fmt):
    torch.manual_seed(0)
    x = torch.randn(64, 4, 128)
    y = kv_quant.round_trip(x, fmt)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert rel_error(y, x) < RT_BOUND[fmt]
    if fmt == "fp4_e2m1":  # per element: at most one block scale amax / d, d >= 5 where the
        # 4 -> 6 gap is used (half of it), d = 4 otherwise (y <= 4: half the 3 -> 4 gap)
        bmax = x.reshape(64, 4, 8, 16).abs().amax(-1, keepdim=True)
        err = (y - x).abs().reshape(64, 4, 8, 16)
        assert (err <= bmax / 5 * 1.07 + 1e-6).all()
        with kv_fp4.scale_rule("amax/6"):  # the previous rule: one amax / 6 block scale
            err6 = (kv_quant.round_trip(x, fmt) - x).abs().reshape(64, 4, 8, 16)
        assert (err6 <= bmax / 6 * 1.07 + 1e-6).all()
    else:  # normal range: half an ulp of the element's mantissa
        mant = 3 if fmt == "fp8_e4m3" else 2
        s = x.abs().amax() * kv_quant.SCALE_HEADROOM / kv_quant.format_max(fmt)
        tiny = s * 2.0 ** (-6 if fmt == "fp8_e4m3" else -14)
        assert ((y - x).abs() <= x.abs() * 2.0 ** -(mant + 1) + tiny).all()


@pytest.mark.parametrize("fmt", QUANT)
def test_round_trip_adversarial(fmt):
    torch.manual_seed(1)
    # zeros: stored as zeros, the scale stays unset until a non-zero write
    z = torch.zeros(8, 32)
    sc = torch.zeros(1)
    kv_quant.update_scales(sc, fmt, z)
    assert sc.item() == 0 and (kv_quant.round_trip(z, fmt, sc) == 0).all()
    # subnormal float32 inputs: finite, tiny error
    sub = torch.full((4, 32), 1e-40) * torch.randn(4, 32).sign()
    y = kv_quant.round_trip(sub, fmt)
    assert torch.isfinite(y).all() and (y - sub).abs().max() <= 2e-40
    # mixed with ordinary values: the subnormals flush to (near) zero, the rest stays accurate
    mix = torch.randn(4, 32)
    mix[:, ::2] = 1e-40
    y = kv_quant.round_trip(mix, fmt)
    assert torch.isfinite(y).all() and rel_error(y, mix) < RT_BOUND[fmt]
    # outliers: one huge value per row; finite, error bounded by the outlier's scale
    out = torch.randn(16, 64)
    out[:, 5] = 1e4
    y = kv_quant.round_trip(out, fmt)
    assert torch.isfinite(y).all()
    assert (y[:, 5] - 1e4).abs().max() <= 1e4 * 0.13
    # values beyond the first write's headroom saturate, never inf/nan
    sc = torch.zeros(1)
    kv_quant.update_scales(sc, fmt, torch.ones(4))
    big = kv_quant.dequantize(kv_quant.quantize(torch.full((32,), 1e6), sc[0], fmt), sc[0], fmt,
                              torch.float32)
    assert torch.isfinite(big).all() and big.max() <= kv_quant.SCALE_HEADROOM * 1.01


@pytest.mark.parametrize("fmt", QUANT)
def test_round_trip_random_outliers_zeros_subnormals(fmt):
    torch.manual_seed(0)
    x = torch.randn(64, 128)
    y = kv_quant.round_trip(x, fmt, granularity=TH)
    assert y.shape == x.shape and rel_error(y, x) < RT_BOUND[fmt]
    # rows of very different ranges: each row is as accurate as alone (a per-layer scale is not)
    wide = torch.randn(8, 64) * torch.logspace(-6, 4, 8)[:, None]
    th = kv_quant.round_trip(wide, fmt, granularity=TH)
    per_row = max(rel_error(a, b) for a, b in zip(th, wide))
    tens = kv_quant.round_trip(wide, fmt)
    assert per_row < RT_BOUND[fmt] < max(rel_error(a, b) for a, b in zip(tens, wide))
    # zeros: exact zeros, no NaN
    z = kv_quant.round_trip(torch.zeros(3, 32), fmt, granularity=TH)
    assert torch.equal(z, torch.zeros(3, 32))
    # subnormal float32 rows: finite, and tiny rows keep their relative accuracy
    sub = torch.full((2, 32), 1e-40) * torch.randn(2, 32).sign()
    ys = kv_quant.round_trip(sub, fmt, granularity=TH)
    assert torch.isfinite(ys).all() and (ys - sub).abs().max() <= 2e-40
    tiny = torch.randn(4, 32) * 1e-30
    assert rel_error(kv_quant.round_trip(tiny, fmt, granularity=TH), tiny) < RT_BOUND[fmt]
    # an outlier: never inf/NaN, the row's max is stored (nearly) exactly
    out = torch.randn(16, 64)
    out[:, 5] = 1e4
    yo = kv_quant.round_trip(out, fmt, granularity=TH)
    assert torch.isfinite(yo).all() and (yo[:, 5] - 1e4).abs().max() <= 1e4 * 0.01


def test_row_layouts():
    x = torch.tensor([[1.0, -2.0, 448.0] + [0.0] * 13])
    q = kv_quant.quant_rows(x, "fp8_e4m3")  # 16 values + bf16 scale (448 / 448 = 1.0)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (1, 18)
    assert q[0, 16:].view(torch.uint8).tolist() == [0x80, 0x3F]  # bf16 1.0 = 0x3F80, LE
    assert q[0, :3].float().tolist() == [1.0, -2.0, 448.0]
    # fp4: E8M0 byte after codes and block scales: 2**e the least power of two >= amax / 1792
    # (4 x 448: every candidate amax / d, d >= 4, fits E4M3); the largest block scale in
    # [144, 448] (E4M3 of amax / 6 / 2**e > 149.3 at least), never subnormal
    torch.manual_seed(1)
    for amax in (1e-20, 0.3, 1.0, 1.75, 1792.0, 2688.0, 5e5):
        r = torch.randn(4, 64)
        r = r / r.abs().amax(-1, keepdim=True) * amax
        p = kv_quant.quant_rows(r, "fp4_e2m1")
        assert p.dtype == torch.uint8 and p.shape == (4, kv_quant.stored_dim("fp4_e2m1", 64, TH))
        e = p[:, -1].double() - 127
        ratio = r.abs().amax(-1).double() / 1792.0 / 2.0 ** e
        assert ((ratio <= 1) & (ratio > 0.5)).all(), (amax, e)
        bs = p[:, 32:36].contiguous().view(torch.float8_e4m3fn).float().amax(-1)
        assert ((bs >= 144) & (bs <= 448)).all(), (amax, bs)
    assert kv_quant.stored_dim("fp4_e2m1", 128, TH) == 73
    assert kv_quant.stored_dim("fp8_e5m2", 128, TH) == 130
    assert kv_quant.value_dim("fp4_e2m1", 73, TH) == 128


@pytest.mark.parametrize("fmt", ("fp8_e4m3", "fp8_e5m2"))
def test_fp8_row_scale_is_at_the_formats_floor(fmt):
    """No per-row scale does measurably better than the stored bf16(amax / max): sweeping the
    scale down by eighths of an octave (more values in the format's finer range, the largest
    saturating) lowers the relative RMS error by under 1 % on Gaussian and outlier rows. What
    fp8 loses is its mantissa, not the scale (docs/kv_cache.md, "Accuracy")."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4000, 128, generator=g)
    for rows in (x, x * torch.where(torch.rand(4000, 128, generator=g) < 0.02, 20.0, 1.0)):
        ours = kv_quant.dequant_rows(kv_quant.quant_rows(rows, fmt), fmt, torch.float32)
        fmax = kv_quant.format_max(fmt)
        amax = rows.abs().amax(-1, keepdim=True)

        def rel(y):
            return ((y - rows).pow(2).mean() / rows.pow(2).mean()).sqrt().item()
        best = min(rel(kv_quant.dequant_fp8(kv_quant.quant_fp8(rows, amax / fmax * 2 ** (-i / 8), fmt),
                                            amax / fmax * 2 ** (-i / 8), torch.float32))
                   for i in range(9))
        assert best <= rel(ours) <= 1.01 * best
