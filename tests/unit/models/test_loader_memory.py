"""Loading without a host copy: meta build, one allocation per parameter on the target device
in the target dtype, tensor-by-tensor file reads (no mmap), and the numbers that say so."""
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import zlib

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from megainfer.config import LoadConfig, ModelConfig
from megainfer.models import ParallelContext, build_model
from megainfer.models.loader import CorruptCheckpointError
from megainfer.models.safetensors_io import SafetensorsFile, Scratch
from repo_paths import REPO

MB = 2 ** 20


def _cfg(**kw):
    d = dict(model_type="mixtral", vocab_size=64, hidden_size=32, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
             num_experts_per_tok=2, intermediate_size=48)
    d.update(kw)
    return ModelConfig.from_hf_dict(d)


def _build(path, dtype="float32", **kw):
    return build_model(ModelConfig.from_pretrained(path), LoadConfig(path=path, dtype=dtype), **kw)


def _tp(rank):
    return ParallelContext(rank, 2, lambda t: t)


def _assert_same(model, ref_fp32, dtype):
    """Every parameter of model is ref's fp32 value rounded to dtype, bit for bit."""
    got, want = dict(model.named_parameters()), dict(ref_fp32.named_parameters())
    assert got.keys() == want.keys()
    for n, p in got.items():
        assert p.dtype == dtype and p.device.type == "cpu", n
        assert torch.equal(p, want[n].to(dtype)), n


# ----------------------------------------------------------------------------- peak memory
_MEASURE = r"""
import json, sys
import torch
torch.set_num_threads(1)
from megainfer.config import LoadConfig, ModelConfig
from megainfer.models import build_model

def status():
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[k] = int(v.split()[0]) * 1024
    return out

path = sys.argv[1]
cfg = ModelConfig.from_pretrained(path)
# Warm-up: the first model built on the meta device pulls in torch's Python meta kernels
# (~170 MB of imports and libraries, whatever the model's size). Pay it before the baseline.
tiny = ModelConfig.from_hf_dict(dict(model_type="mixtral", vocab_size=64, hidden_size=32,
    num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
    num_experts_per_tok=2, intermediate_size=48))
build_model(tiny, LoadConfig(load_format="dummy", dtype="bfloat16"))
try:  # reset VmHWM to the current RSS (Linux >= 4.0); else the old peak only overstates growth
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    reset = True
except OSError:
    reset = False
base = status()
quant = sys.argv[2] if len(sys.argv) > 2 else None  # model.quantization
model = build_model(cfg, LoadConfig(path=path, dtype="bfloat16", quantization=quant))
after = status()
ps = list(model.parameters())
print(json.dumps(dict(base=base, after=after, reset=reset,
                      model_bytes=sum(p.numel() * p.element_size() for p in ps),
                      dtypes=sorted({str(p.dtype) for p in ps}))))
"""


def _big_bf16_checkpoint(out):
    """Mixtral, 2 layers, hidden 1024, 8 experts of 1024, vocab 16384: ~170 MB in bf16; the
    largest tensors are the 32 MB embedding and lm_head."""
    H, N, L, E, V, heads, kv = 1024, 1024, 2, 8, 16384, 8, 2
    D = H // heads
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)
    t = {"model.embed_tokens.weight": r(V, H), "lm_head.weight": r(V, H), "model.norm.weight": r(H)}
    for layer in range(L):
        p = f"model.layers.{layer}."
        t[p + "input_layernorm.weight"], t[p + "post_attention_layernorm.weight"] = r(H), r(H)
        t[p + "self_attn.q_proj.weight"], t[p + "self_attn.o_proj.weight"] = r(H, H), r(H, H)
        t[p + "self_attn.k_proj.weight"] = r(kv * D, H)
        t[p + "self_attn.v_proj.weight"] = r(kv * D, H)
        t[p + "block_sparse_moe.gate.weight"] = r(E, H)
        for e in range(E):
            q = p + f"block_sparse_moe.experts.{e}."
            t[q + "w1.weight"], t[q + "w3.weight"], t[q + "w2.weight"] = r(N, H), r(N, H), r(H, N)
    os.makedirs(out, exist_ok=True)
    save_file(t, os.path.join(out, "model.safetensors"))
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(dict(model_type="mixtral", vocab_size=V, hidden_size=H, num_hidden_layers=L,
                       num_attention_heads=heads, num_key_value_heads=kv, num_local_experts=E,
                       num_experts_per_tok=2, intermediate_size=N, max_position_embeddings=512,
                       tie_word_embeddings=False, torch_dtype="bfloat16"), f)
    sizes = [x.numel() * x.element_size() for x in t.values()]
    return sum(sizes), max(sizes)


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux /proc")
def test_bf16_load_peak_is_model_plus_largest_tensor(tmp_path):
    ckpt = str(tmp_path / "big")
    ckpt_bytes, largest = _big_bf16_checkpoint(ckpt)
    assert ModelConfig.from_pretrained(ckpt).num_experts == 8
    res = subprocess.run([sys.executable, "-c", _MEASURE, ckpt], cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    m = json.loads(res.stdout.strip().splitlines()[-1])
    model_bytes, growth = m["model_bytes"], m["after"]["VmHWM"] - m["base"]["VmRSS"]
    assert m["dtypes"] == ["torch.bfloat16"] and model_bytes == ckpt_bytes
    slack = 32 * MB
    bound = model_bytes + largest + slack
    print(f"model {model_bytes / MB:.1f} MB, largest tensor {largest / MB:.1f} MB, peak growth "
          f"{growth / MB:.1f} MB (bound {bound / MB:.1f} MB, VmHWM reset: {m['reset']})")
    assert growth <= bound
    # the measurement does see the model (it is not measuring nothing) ...
    assert growth >= 0.9 * model_bytes
    # ... and the old path (fp32 model on the host, then .to(bf16): 2x + 1x, plus mmap'd file
    # pages in the RSS) could not have met the bound
    old = 2 * model_bytes + model_bytes
    assert bound < 0.6 * old


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux /proc")
@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_quantised_load_peak_is_stored_model_plus_one_tensor(tmp_path, quant):
    """Quantising on load (issue 50) holds one tensor in float32 at a time, never a
    full-precision model: the peak is the stored model plus the largest tensor (plus one
    float32 copy of a quantised one and its quantisation temporaries), well under the
    checkpoint's own bf16 bytes plus the stored model."""
    ckpt = str(tmp_path / "big")
    ckpt_bytes, largest = _big_bf16_checkpoint(ckpt)
    res = subprocess.run([sys.executable, "-c", _MEASURE, ckpt, quant], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    m = json.loads(res.stdout.strip().splitlines()[-1])
    model_bytes, growth = m["model_bytes"], m["after"]["VmHWM"] - m["base"]["VmRSS"]
    assert {"torch.int8" if quant == "int8" else "torch.uint8", "torch.bfloat16"} <= set(m["dtypes"])
    assert model_bytes < 0.75 * ckpt_bytes  # the experts and projections are stored smaller
    per_tensor = 4 * 1024 * 1024 * 4  # one 1024 x 1024 weight in float32, and a temporary
    bound = model_bytes + largest + per_tensor + 32 * MB
    print(f"{quant}: stored model {model_bytes / MB:.1f} MB (checkpoint {ckpt_bytes / MB:.1f} "
          f"MB), peak growth {growth / MB:.1f} MB (bound {bound / MB:.1f} MB)")
    assert 0.9 * model_bytes <= growth <= bound
    assert bound < ckpt_bytes + model_bytes  # a full-precision copy could not meet it


# ----------------------------------------------------------------------------- values
def test_rotary_inv_freq_stays_fp32_and_buffers_are_real(tiny_ckpts):
    src = tiny_ckpts[("qwen3_moe", "base")]
    ref = _build(src)
    for dtype in ("bfloat16", "float16"):
        m = _build(src, dtype)
        for layer, r in zip(m.layers, ref.layers):
            rot = layer.self_attn.rotary
            assert rot.inv_freq.dtype == torch.float32 and not rot.inv_freq.is_meta
            assert torch.equal(rot.inv_freq, r.self_attn.rotary.inv_freq)
            theta, D = m.config.rope_theta, 2 * rot.inv_freq.numel()
            want = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D))
            assert torch.equal(rot.inv_freq, want)
        assert not any(b.is_meta for b in m.buffers())
    ex = _build(src, "bfloat16", role="experts", expert_slots=[[1, 3]] * 2,
                phy2log=[[0, 1, 2, 3]] * 2).layers[0].mlp.experts
    assert ex.expert_map.dtype == torch.int32 and ex.expert_map.tolist() == [-1, 0, -1, 1]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_load_equals_fp32_then_cast(tiny_ckpts, tmp_path, dtype):
    """Loading straight into bf16/fp16 rounds exactly as loading fp32 then .to(dtype) did: full
    model, a TP rank (row slices and the o_proj column slice), expert slots with replicas, and
    the fused expert layout."""
    target = getattr(torch, dtype)
    src = tiny_ckpts[("qwen2_moe", "base")]
    _assert_same(_build(src, dtype), _build(src), target)
    _assert_same(_build(src, dtype, par=_tp(1)), _build(src, par=_tp(1)), target)
    kw = dict(role="experts", expert_slots=[[3, 4, 5]] * 2, phy2log=[[0, 1, 2, 3, 1, 2]] * 2)
    _assert_same(_build(src, dtype, **kw), _build(src, **kw), target)
    fused = str(tmp_path / "fused")
    shutil.copytree(src, fused)
    f = os.path.join(fused, "model.safetensors")
    t = load_file(f)
    for layer in range(2):
        p = f"model.layers.{layer}.mlp.experts"
        t[f"{p}.gate_up_proj"] = torch.stack([torch.cat([t.pop(f"{p}.{e}.gate_proj.weight"),
                                                         t.pop(f"{p}.{e}.up_proj.weight")])
                                              for e in range(4)])
        t[f"{p}.down_proj"] = torch.stack([t.pop(f"{p}.{e}.down_proj.weight") for e in range(4)])
    save_file(t, f)
    _assert_same(_build(fused, dtype, **kw), _build(src, **kw), target)


def test_bf16_checkpoint_reads_straight_and_converts(tiny_ckpts, tmp_path):
    """A bf16 checkpoint: read straight into a bf16 model; converted into an fp32 one."""
    src = tiny_ckpts[("mixtral", "base")]
    dst = str(tmp_path / "bf16")
    shutil.copytree(src, dst)
    f = os.path.join(dst, "model.safetensors")
    save_file({n: x.to(torch.bfloat16) for n, x in load_file(f).items()}, f)
    _assert_same(_build(dst, "bfloat16", par=_tp(0)), _build(src, par=_tp(0)), torch.bfloat16)
    m32 = _build(dst, "float32")
    for n, p in _build(src).named_parameters():
        assert torch.equal(dict(m32.named_parameters())[n], p.to(torch.bfloat16).float()), n


def test_tied_embeddings_stay_tied(tiny_ckpts, tmp_path):
    cfg = _cfg(tie_word_embeddings=True)
    for dtype in ("float32", "bfloat16"):
        m = build_model(cfg, LoadConfig(load_format="dummy", seed=1, dtype=dtype))
        assert m.lm_head.weight is m.model.embed_tokens.weight
        assert m.lm_head.weight.dtype == getattr(torch, dtype)
    src = tiny_ckpts[("mixtral", "base")]
    dst = str(tmp_path / "tied")
    shutil.copytree(src, dst)
    f = os.path.join(dst, "model.safetensors")
    t = load_file(f)
    t.pop("lm_head.weight")
    save_file(t, f)
    with open(os.path.join(dst, "config.json")) as fh:
        c = json.load(fh)
    c["tie_word_embeddings"] = True
    with open(os.path.join(dst, "config.json"), "w") as fh:
        json.dump(c, fh)
    m = _build(dst, "bfloat16")
    assert m.lm_head.weight is m.model.embed_tokens.weight
    assert torch.equal(m.lm_head.weight, t["model.embed_tokens.weight"].to(torch.bfloat16))


def _old_seeded(name, shape, seed, std):  # the loader's dummy draw before the rewrite
    g = torch.Generator().manual_seed((zlib.crc32(name.encode()) ^ seed) & 0x7FFFFFFF)
    return torch.randn(shape, generator=g) * std


def test_dummy_weights_unchanged():
    cfg, seed = _cfg(), 3
    H, N = cfg.hidden_size, cfg.moe_intermediate_size
    phy2log = [[0, 1, 2, 3, 1, 2]] * 2
    for dtype in ("float32", "bfloat16"):
        target = getattr(torch, dtype)
        load = LoadConfig(load_format="dummy", seed=seed, dtype=dtype)
        full = build_model(cfg, load)
        tp1 = build_model(cfg, load, par=_tp(1))
        ex = build_model(cfg, load, role="experts", expert_slots=[[4, 5]] * 2, phy2log=phy2log)
        emb = "model.embed_tokens.weight"
        assert torch.equal(full.model.embed_tokens.weight,
                           _old_seeded(emb, (cfg.vocab_size, H), seed, 1.0).to(target))
        q = "model.layers.0.self_attn.q_proj.weight"
        assert torch.equal(tp1.layers[0].self_attn.q_proj.weight,
                           _old_seeded(q, (H, H), seed, H ** -0.5)[H // 2:].to(target))
        o = "model.layers.1.self_attn.o_proj.weight"
        assert torch.equal(tp1.layers[1].self_attn.o_proj.weight,
                           _old_seeded(o, (H, H), seed, H ** -0.5)[:, H // 2:].to(target))
        assert torch.equal(full.layers[0].input_layernorm.weight, torch.ones(H, dtype=target))
        for local, logical in enumerate((1, 2)):  # slots 4, 5 hold logical experts 1, 2
            base = f"model.layers.1.mlp.experts.{logical}"
            gu = _old_seeded(base + ".gate_up", (2 * N, H), seed, H ** -0.5)
            assert torch.equal(ex.layers[1].mlp.experts.gate_up_proj[local], gu.to(target))
            assert torch.equal(ex.layers[1].mlp.experts.down_proj[local],
                               _old_seeded(base + ".down", (H, N), seed, N ** -0.5).to(target))


# ----------------------------------------------------------------------------- the reader
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64,
                                   torch.int64, torch.int32])
def test_reader_rows_match_safetensors(tmp_path, dtype):
    f = str(tmp_path / "x.safetensors")
    x = (torch.randn(5, 3, 4) * 100).to(dtype)
    save_file({"x": x, "s": torch.ones((), dtype=dtype), "e": torch.zeros(0, 7, dtype=dtype)}, f)
    scratch = Scratch()
    with SafetensorsFile(f) as sf, safe_open(f, "pt") as ref:
        assert sf.info("x").shape == (5, 3, 4) and sf.info("x").dtype == dtype
        assert torch.equal(sf.read_into("x", scratch.get(x.numel() * x.element_size())), x)
        assert torch.equal(sf.read_into("x", scratch.get(64 * 4), rows=(1, 3)),
                           ref.get_slice("x")[1:3])
        assert torch.equal(sf.read_into("s", scratch.get(8)), ref.get_tensor("s"))
        assert sf.read_into("e", scratch.get(0)).shape == (0, 7)
        out = torch.empty(3, 4, dtype=dtype)  # straight into a tensor of the same dtype
        sf.read_into("x", out, rows=(4, 5))
        assert torch.equal(out, x[4])


def _rewrite_header(fn, mutate):
    with open(fn, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header, data = json.loads(f.read(n)), f.read()
    mutate(header)
    raw = json.dumps(header).encode()
    with open(fn, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data)


def _set(name, key, value):
    return lambda h: h[name].__setitem__(key, value)


def _raw_bytes(data):
    def write(fn):
        with open(fn, "wb") as f:
            f.write(data)
    return write


Q = "model.layers.1.self_attn.q_proj.weight"
HEADER_BAD = [
    ("unknown_dtype", _set(Q, "dtype", "F8_E9"), [Q, "unknown dtype"]),
    ("offsets_past_end", _set(Q, "data_offsets", [0, 10 ** 9]), [Q, "data_offsets"]),
    ("offsets_reversed", _set(Q, "data_offsets", [64, 0]), [Q, "data_offsets"]),
    ("bad_shape", _set(Q, "shape", [-1, 64]), [Q, "shape"]),
]


@pytest.mark.parametrize("case,mutate,words", HEADER_BAD, ids=[b[0] for b in HEADER_BAD])
def test_bad_header_entries(tiny_ckpts, tmp_path, case, mutate, words):
    bad = str(tmp_path / case)
    shutil.copytree(tiny_ckpts[("mixtral", "base")], bad)
    _rewrite_header(os.path.join(bad, "model.safetensors"), mutate)
    with pytest.raises(CorruptCheckpointError) as e:
        _build(bad)
    for w in words + ["model.safetensors"]:
        assert w in str(e.value)


@pytest.mark.parametrize("case,data", [
    ("short", b"\x01\x02"),
    ("huge_header", struct.pack("<Q", 2 ** 40) + b"{}"),
    ("not_json", struct.pack("<Q", 4) + b"nope"),
])
def test_bad_file_headers(tiny_ckpts, tmp_path, case, data):
    bad = str(tmp_path / case)
    shutil.copytree(tiny_ckpts[("mixtral", "base")], bad)
    _raw_bytes(data)(os.path.join(bad, "model.safetensors"))
    with pytest.raises(CorruptCheckpointError, match="model.safetensors"):
        _build(bad)


def test_index_naming_a_tensor_its_file_lacks(tiny_ckpts, tmp_path):
    src = tiny_ckpts[("mixtral", "base")]
    dst = tmp_path / "idx"
    shutil.copytree(src, dst)
    names = list(load_file(os.path.join(src, "model.safetensors")))
    wmap = {n: "model.safetensors" for n in names}
    wmap["model.norm.weight"] = "model-2.safetensors"
    save_file({"other": torch.zeros(2)}, str(dst / "model-2.safetensors"))
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wmap}))
    with pytest.raises(CorruptCheckpointError, match=r"model\.norm\.weight.*model-2\.safetensors"):
        _build(str(dst))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_load_matches_host(tiny_ckpts):
    src = tiny_ckpts[("qwen3_moe", "base")]
    host = _build(src, "bfloat16", par=_tp(1))
    dev = _build(src, "bfloat16", par=_tp(1), device="cuda")
    for (n, p), q in zip(host.named_parameters(), dev.parameters()):
        assert q.is_cuda and torch.equal(q.cpu(), p), n
    assert all(b.is_cuda for b in dev.buffers())
    assert dev.layers[0].self_attn.rotary.inv_freq.dtype == torch.float32
    load = LoadConfig(load_format="dummy", seed=2, dtype="bfloat16")
    d, h = build_model(_cfg(), load, device="cuda"), build_model(_cfg(), load)
    for p, q in zip(h.parameters(), d.parameters()):
        assert torch.equal(q.cpu(), p)
    assert math.isfinite(float(d.model.embed_tokens.weight.float().sum()))
