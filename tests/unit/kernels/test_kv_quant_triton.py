"""Triton paged attention over a float8 KV cache (interpreter or GPU) against the torch path
over the same float8 cache (kernels/kv_quant.py, models/attention.py).

Triton kernels over a token_head KV cache (each row's scale inline; kernels/kv_quant.py):
the store writes the bytes ``kv_quant.quant_rows`` writes, and prefill / decode read them as
the torch path does (interpreter or GPU)."""
import os

import pytest
import torch

from megainfer.kernels import kv_quant
from megainfer.models.attention_backends import TorchAttention, make_attention_backend
from megainfer.models.kv_spec import KVCacheSpec
from kv_quant_util import rel_error, run_paged

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and
                                not torch.cuda.is_available(),
                                reason="Triton needs a GPU or TRITON_INTERPRET=1")
DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"


@pytest.fixture
def on_device():
    """Kernel-level tests build their tensors on DEVICE (the default device inside): the
    compiled kernels take device pointers only; under the interpreter that is the CPU."""
    with torch.device(DEVICE):
        yield


@pytest.mark.parametrize("fmt", ("fp8_e4m3", "fp8_e5m2"))
@pytest.mark.parametrize("D", (64, 40))
@pytest.mark.usefixtures("on_device")
def test_triton_fp8_matches_torch_fp8(fmt, D):
    ref, ref_cache = run_paged(fmt, D, backend=TorchAttention())
    got, cache = run_paged(fmt, D, backend=make_attention_backend("triton"))
    assert cache.dtype == ref_cache.dtype
    assert torch.equal(kv_quant.scales_of(cache), kv_quant.scales_of(ref_cache))
    # the stored bytes are the same (one rounding, saturating), outputs agree in fp32
    assert torch.equal(cache.view(torch.uint8), ref_cache.view(torch.uint8))
    for r, g in zip(ref, got):  # prefill (mixed, with context), then a pure decode step
        assert (g - r).abs().max() < 1e-4
    full, _ = run_paged("auto", D)
    assert rel_error(got[-1], full[-1]) < 0.1


@pytest.mark.parametrize("fmt", ("fp8_e4m3", "fp8_e5m2"))
@pytest.mark.usefixtures("on_device")
def test_triton_mla_fp8_decode_matches_torch(fmt):
    from megainfer.kernels import triton_mla
    from megainfer.models.mla_attention import mla_decode_torch, store_latent_torch
    torch.manual_seed(5)
    S, H, R, P, BS = 3, 4, 32, 16, 16
    cache = KVCacheSpec("mla", (R + P,), torch.float32, 1, fmt, (R, P)).allocate(6, BS)[0]
    lat = torch.randn(90, R + P)
    lat[:, R:] *= 5
    store_latent_torch(lat, cache, torch.arange(90), R)
    tables = torch.tensor([[0, 1, 2], [3, 4, 0], [5, 0, 0]])
    seq_lens = torch.tensor([40, 20, 9])
    q_lat, q_pe = torch.randn(S, H, R), torch.randn(S, H, P)
    ref = mla_decode_torch(q_lat, q_pe, cache, seq_lens, tables, 0.1)
    got = triton_mla.mla_decode(q_lat, q_pe, cache, seq_lens, tables, 0.1, R,
                                scales=kv_quant.scales_of(cache))
    assert (got - ref).abs().max() < 1e-4
    with pytest.raises(Exception, match="scales"):
        triton_mla.mla_decode(q_lat, q_pe, cache, seq_lens, tables, 0.1, R)


@pytest.mark.parametrize("family", ("mixtral", "deepseek_v3"))
def test_triton_engine_fp8_matches_torch_engine_fp8(tiny_ckpts, tmp_path, family):
    from megainfer import LLM, SamplingParams
    from megainfer.config import ConfigError
    if family == "deepseek_v3":
        from megainfer.tools.make_tiny import make_tiny
        path = make_tiny("deepseek_v3", str(tmp_path / "ds"))
    else:
        path = tiny_ckpts[(family, "base")]
    kw = dict(dtype="float32", device=DEVICE, max_num_batched_tokens=24, max_num_seqs=4,
              max_model_len=128, num_blocks=64, block_size=8, cuda_graphs=False,
              kv_cache_dtype="fp8_e4m3")
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 31, 12)]
    sp = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    tri, got, ref = _greedy_on_both_backends(path, kw, prompts, sp)
    assert tri.engine.kv_caches[0].dtype == torch.float8_e4m3fn
    assert got == ref
    if family == "mixtral":  # fp4: the Triton kernels read it; a head size it cannot pack: refused
        f4 = {**kw, "kv_cache_dtype": "fp4_e2m1"}
        tri, got, ref = _greedy_on_both_backends(path, f4, prompts, sp)
        assert tri.engine.kv_caches[0].dtype == torch.uint8
        assert got == ref
    else:
        with pytest.raises(ConfigError, match="cache.kv_cache_dtype=fp4_e2m1.*qk_rope_head_dim"):
            LLM(path, attention_backend="triton", **{**kw, "kv_cache_dtype": "fp4_e2m1"})


@pytest.mark.parametrize("D", (64, 48))
@pytest.mark.usefixtures("on_device")
def test_triton_fp4_matches_torch_fp4(D):
    ref, ref_cache = run_paged("fp4_e2m1", D, backend=TorchAttention())
    got, cache = run_paged("fp4_e2m1", D, backend=make_attention_backend("triton"))
    # the Triton store quantised what the torch quantiser packed: the same bytes
    assert torch.equal(kv_quant.scales_of(cache), kv_quant.scales_of(ref_cache))
    assert torch.equal(cache, ref_cache)
    from megainfer.kernels import triton_attention
    from megainfer.kernels.entry_points import KernelInputError
    with pytest.raises(KernelInputError, match="scales"):  # float rows without scales: refused
        triton_attention.store_kv(torch.randn(1, 2, D), torch.randn(1, 2, D), cache,
                                  torch.zeros(1, dtype=torch.long))
    with pytest.raises(KernelInputError, match="fp4_e2m1"):  # rows of the wrong size: refused
        triton_attention.store_kv(torch.randn(1, 2, D + 16), torch.randn(1, 2, D + 16), cache,
                                  torch.zeros(1, dtype=torch.long), kv_quant.scales_of(cache))
    # packed rows: copied through the slot mapping, -1 (graph padding) writes nothing
    before = cache.clone()
    rows = torch.randint(0, 255, (2, 2, cache.shape[-1]), dtype=torch.uint8)
    triton_attention.store_kv(rows, rows.flip(0), cache, torch.tensor([-1, 70]))
    assert torch.equal(cache[0, 4, 6], rows[1]) and torch.equal(cache[1, 4, 6], rows[0])
    cache[:, 4, 6] = before[:, 4, 6]
    assert torch.equal(cache, before)
    for r, g in zip(ref, got):
        assert (g - r).abs().max() < 1e-4


def fp4_rows(T: int, H: int, D: int):
    """Keys and values [T, H, D] for the fp4 store tests: Gaussian rows, channel ranges, an
    outlier, zeros, 1e-30 and subnormal blocks, and rows of grid values (multiples of 1/2 or
    1/4: several block-scale candidates store them exactly, ties for the least error)."""
    torch.manual_seed(11)
    k = torch.randn(T, H, D)
    k[0] *= torch.logspace(-4, 1, D)
    k[2, 1, 5] = 300.0  # an outlier (beyond the per-layer scale's headroom: saturates)
    k[3] = torch.randint(-12, 13, (H, D)) * 0.5
    k[4, 0] = (torch.randn(D) * 4).round() / 4
    k[4, 1] = torch.randn(D).sign() * 1.75
    v = torch.randn(T, H, D)
    v[0] = 0.0
    v[1, 0, :16] = 1e-30
    v[1, 1, 16:] = 1e-41  # subnormal float32 values
    v[5, 0, :16] = 0.0
    v[5, 0, 3], v[5, 0, 4] = 1.5, 1.125  # with scale 1: d = 4 stores both exactly, d = 6 not
    return k, v


def fp4_reference(k, v, cache, slots, scales, gran, rule="lsq"):
    """The cache ``kv_quant`` (torch) writes for k, v through ``slots`` (-1: nothing)."""
    from megainfer.kernels import kv_fp4
    H = k.shape[1]
    ref = torch.zeros_like(cache)
    flat, ok = ref.view(2, -1, H, ref.shape[-1]), slots >= 0
    with kv_fp4.scale_rule(rule):
        flat[0, slots[ok]] = kv_quant.quantize(k[ok], scales[0], "fp4_e2m1", gran)
        flat[1, slots[ok]] = kv_quant.quantize(v[ok], scales[1], "fp4_e2m1", gran)
    return ref


@pytest.mark.usefixtures("on_device")
def test_triton_fp4_store_bit_identical_adversarial():
    """Gaussian rows, outliers, zeros, tiny (subnormal-scale) blocks, saturation and ties: the
    in-kernel quantiser (least-squared-error block scales) writes the bytes kv_quant.quant_fp4
    writes, which differ from the amax / 6 rule's; -1 slots write nothing."""
    from megainfer.kernels import triton_attention
    T, H, D = 8, 2, 32
    k, v = fp4_rows(T, H, D)
    cache = KVCacheSpec("gqa", (2, H, D), torch.float32, 1, "fp4_e2m1").allocate(3, 4)[0]
    sc = kv_quant.scales_of(cache)
    kv_quant.update_scales(sc, "fp4_e2m1", k[5:], v[5:])  # scales from other tokens
    slots = torch.tensor([3, -1, 0, 11, 5, 6, 1, 8])
    triton_attention.store_kv(k, v, cache, slots, sc)
    assert torch.equal(cache, fp4_reference(k, v, cache, slots, sc, "tensor"))
    assert not torch.equal(cache, fp4_reference(k, v, cache, slots, sc, "tensor", "amax/6"))


def mla_store_and_decode(fmt, gran, adversarial=False):
    """The Triton MLA store and decode against the torch ones on one quantised latent cache
    (``gran`` scales; ``adversarial``: a zero row and a 1e-30 c_kv row among the tokens):
    stored bytes equal, decode within 1e-4. Returns the pieces for further checks."""
    from megainfer.kernels import triton_mla
    from megainfer.models.mla_attention import mla_decode_torch, store_latent_torch
    torch.manual_seed(5)
    S, H, R, P, BS = 3, 4, 32, 16, 16
    spec = KVCacheSpec("mla", (R + P,), torch.float32, 1, fmt, (R, P), gran)
    ref_cache, cache = spec.allocate(6, BS)[0], spec.allocate(6, BS)[0]
    lat = torch.randn(90, R + P)
    lat[:, R:] *= 5
    if adversarial:
        lat[3] = 0.0
        lat[4, :R] *= 1e-30
    slots = torch.arange(90)
    slots[7] = -1  # CUDA-graph padding: skipped
    store_latent_torch(lat[slots >= 0], ref_cache, slots[slots >= 0], R)
    sc = kv_quant.scales_of(cache)
    sc.copy_(kv_quant.scales_of(ref_cache))  # tensor: the torch store's; token_head: unused
    triton_mla.store_latent(lat, cache, slots, sc, R)  # quantised in the kernel
    assert torch.equal(cache.view(torch.uint8), ref_cache.view(torch.uint8))
    if fmt == "fp4_e2m1":  # least-squared-error block scales, not amax / 6's
        from megainfer.kernels import kv_fp4
        old = spec.allocate(6, BS)[0]
        kv_quant.scales_of(old).copy_(sc)
        with kv_fp4.scale_rule("amax/6"):
            store_latent_torch(lat[slots >= 0], old, slots[slots >= 0], R)
        assert not torch.equal(cache, old)
    tables = torch.tensor([[0, 1, 2], [3, 4, 0], [5, 0, 0]])
    seq_lens = torch.tensor([40, 20, 9])
    q_lat, q_pe = torch.randn(S, H, R), torch.randn(S, H, P)
    ref = mla_decode_torch(q_lat, q_pe, ref_cache, seq_lens, tables, 0.1)
    got = triton_mla.mla_decode(q_lat, q_pe, cache, seq_lens, tables, 0.1, R, scales=sc)
    assert (got - ref).abs().max() < 1e-4  # dequantised in registers, never gathered whole
    return dict(cache=cache, lat=lat, slots=slots, scales=sc, R=R, P=P, BS=BS, got=got,
                q_lat=q_lat, q_pe=q_pe, seq_lens=seq_lens, tables=tables)


@pytest.mark.parametrize("fmt", ("fp4_e2m1", "fp8_e4m3"))
@pytest.mark.usefixtures("on_device")
def test_triton_mla_quantised_store_and_decode_match_torch(fmt):
    from megainfer.kernels import triton_mla
    from megainfer.kernels.entry_points import KernelInputError
    c = mla_store_and_decode(fmt, "tensor")
    cache, lat, slots, R = c["cache"], c["lat"], c["slots"], c["R"]
    q_lat, q_pe, seq_lens, tables = c["q_lat"], c["q_pe"], c["seq_lens"], c["tables"]
    with pytest.raises(KernelInputError, match="scales"):
        triton_mla.mla_decode(q_lat, q_pe, cache, seq_lens, tables, 0.1, R)
    with pytest.raises(KernelInputError, match="scales"):
        triton_mla.store_latent(lat, cache, slots, None, R)


def test_triton_engine_deepseek_fp4_matches_torch_engine(tmp_path):
    """The fp4 latent cache through the Triton MLA store and decode kernels gives the torch
    path's greedy tokens (tiny DeepSeek-V3 with qk_rope_head_dim=16, which fp4 can pack)."""
    from megainfer import SamplingParams
    from megainfer.tools.make_tiny import make_tiny
    path = make_tiny("deepseek_v3", str(tmp_path / "ds"), qk_rope_head_dim=16)
    kw = dict(dtype="float32", device=DEVICE, max_num_batched_tokens=24, max_num_seqs=4,
              max_model_len=64, num_blocks=32, block_size=8, cuda_graphs=False,
              kv_cache_dtype="fp4_e2m1")
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 19)]
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    tri, got, ref = _greedy_on_both_backends(path, kw, prompts, sp)
    assert tri.engine.kv_caches[0].dtype == torch.uint8
    assert got == ref



def _greedy_on_both_backends(path, kw, prompts, sp):
    """(the Triton-backend LLM, its greedy tokens, the torch backend's tokens)."""
    from megainfer import LLM
    tri = LLM(path, attention_backend="triton", **kw)
    got = [o.outputs[0].token_ids for o in tri.generate(prompts, sp, use_tqdm=False)]
    ref = [o.outputs[0].token_ids for o in
           LLM(path, attention_backend="torch", **kw).generate(prompts, sp, use_tqdm=False)]
    return tri, got, ref


FORMATS = ("fp8_e4m3", "fp8_e5m2", "fp4_e2m1")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("D", (64, 48))
@pytest.mark.usefixtures("on_device")
def test_triton_token_head_matches_torch(fmt, D):
    ref, ref_cache = run_paged(fmt, D, backend=TorchAttention(), gran="token_head")
    got, cache = run_paged(fmt, D, backend=make_attention_backend("triton"), gran="token_head")
    assert cache.shape[-1] == kv_quant.stored_dim(fmt, D, "token_head")
    assert torch.equal(cache.view(torch.uint8), ref_cache.view(torch.uint8))  # same bytes
    assert not kv_quant.scales_of(cache).any()  # no per-layer scale set or needed
    for r, g in zip(ref, got):  # prefill (mixed, with context), then a pure decode step
        assert (g - r).abs().max() < 1e-4


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.usefixtures("on_device")
def test_triton_token_head_store_bit_identical_adversarial(fmt):
    """Outliers, zero rows, tiny (subnormal-range) rows, wide ranges within a row: the kernel
    writes kv_quant.quant_rows' bytes; -1 slots write nothing."""
    from megainfer.kernels import triton_attention
    torch.manual_seed(11)
    T, H, D = 6, 3, 32
    k = torch.randn(T, H, D) * torch.logspace(-4, 1, D)
    k[2, 1, 5] = 3e4
    v = torch.randn(T, H, D)
    v[0] = 0.0
    v[1, 0] = 1e-30 * torch.randn(D)
    v[4, 2, :16] = 1e-41  # subnormal float32 values
    if fmt == "fp4_e2m1":  # and the fp4 tests' rows: grid values (ties), outliers, zeros
        fk, fv = fp4_rows(T, H, D)
        k[3:], v[3:] = fk[3:], fv[3:]
        v[5, 2] = 1.75 * 2.0 ** -10  # amax / 1792 a power of two: e exact
    cache = KVCacheSpec("gqa", (2, H, D), torch.float32, 1, fmt,
                        kv_granularity="token_head").allocate(3, 4)[0]
    slots = torch.tensor([3, -1, 0, 11, 5, 6])
    triton_attention.store_kv(k, v, cache, slots, kv_quant.scales_of(cache))
    ref = torch.zeros_like(cache)
    flat, ok = ref.view(2, -1, H, ref.shape[-1]), slots >= 0
    flat[0, slots[ok]] = kv_quant.quant_rows(k[ok], fmt)
    flat[1, slots[ok]] = kv_quant.quant_rows(v[ok], fmt)
    assert torch.equal(cache.view(torch.uint8), ref.view(torch.uint8))
    if fmt == "fp4_e2m1":  # least-squared-error block scales: not the amax / 6 rule's bytes
        sc = kv_quant.scales_of(cache)
        assert torch.equal(cache, fp4_reference(k, v, cache, slots, sc, "token_head"))
        assert not torch.equal(cache, fp4_reference(k, v, cache, slots, sc, "token_head",
                                                    "amax/6"))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.usefixtures("on_device")
def test_triton_mla_token_head_store_and_decode_match_torch(fmt):
    from megainfer.models.mla_attention import mla_decode_torch, store_latent_torch
    c = mla_store_and_decode(fmt, "token_head", adversarial=True)
    R, P, BS, lat, slots, got = c["R"], c["P"], c["BS"], c["lat"], c["slots"], c["got"]
    q_lat, q_pe, seq_lens, tables = c["q_lat"], c["q_pe"], c["seq_lens"], c["tables"]
    assert c["cache"].shape[-1] == (kv_quant.stored_dim(fmt, R, "token_head")
                                    + kv_quant.stored_dim(fmt, P, "token_head"))
    assert not c["scales"].any()
    full = KVCacheSpec("mla", (R + P,), torch.float32, 1, "auto", (R, P)).allocate(6, BS)[0]
    store_latent_torch(lat[slots >= 0], full, slots[slots >= 0], R)
    exact = mla_decode_torch(q_lat, q_pe, full, seq_lens, tables, 0.1)
    assert (got - exact).norm() / exact.norm() < {"fp8_e4m3": 0.05, "fp8_e5m2": 0.1,
                                                  "fp4_e2m1": 0.2}[fmt]
