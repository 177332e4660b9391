"""FP8 block-quantised checkpoints (DeepSeek-V3 / HF ``quant_method: fp8``), dequantised on load
(the dequantiser itself: tests/unit/models/test_fp8_dequant.py): every malformed case as a typed error,
and a tiny Mixtral quantised to float8_e4m3fn ([32, 32] blocks, hidden 48 and intermediate 72 so edge
blocks exist) loaded whole, tensor-parallel and fused, against a dequantised fp32 copy (which
transformers loads as a plain checkpoint: the comparison never relies on HF's fp8 support)."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from megainfer.config import ConfigError, LoadConfig, ModelConfig
from megainfer.models import ParallelContext, build_model
from megainfer.models.checkpoint_reader import (CheckpointReader, ConfigMismatchError,
                                                CorruptCheckpointError, MissingTensorError,
                                                ShapeMismatchError, UnexpectedTensorError,
                                                checkpoint_files)
from megainfer.models.fp8 import dequantize_blockwise

from test_fp8_dequant import BLOCK, QCFG, _cdiv, _naive, _quantize

QUANTISED = ("q_proj", "k_proj", "v_proj", "o_proj", ".w1.", ".w2.", ".w3.")


def _write(path, tensors, config, quant):
    os.makedirs(path, exist_ok=True)
    cfg = dict(config)
    cfg.pop("quantization_config", None)
    if quant is not None:
        cfg["quantization_config"] = quant
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    return str(path)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """{'fp8': float8 + scales, 'deq': the same weights dequantised to fp32 (no
    quantization_config), 'src': the original}."""
    from megainfer.tools.make_tiny import make_tiny
    root = tmp_path_factory.mktemp("fp8")
    src = make_tiny("mixtral", str(root / "src"), seed=1, hidden=48, inter=72)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    t = load_file(os.path.join(src, "model.safetensors"))
    fp8, deq = {}, {}
    for n, w in t.items():
        if any(k in n for k in QUANTISED) and n.endswith(".weight"):
            q, s = _quantize(w.float(), BLOCK)
            fp8[n], fp8[n + "_scale_inv"] = q, s
            deq[n] = dequantize_blockwise(q, s, BLOCK)
        else:
            fp8[n] = deq[n] = w
    assert any(v.dtype == torch.float8_e4m3fn for v in fp8.values())
    return {"src": src, "src_tensors": t, "config": config, "fp8_tensors": fp8, "deq_tensors": deq,
            "fp8": _write(root / "fp8", fp8, config, QCFG),
            "deq": _write(root / "deq", deq, config, None)}


def _build(path, dtype="float32", **kw):
    """Dequantised on load (model.quantization=fp8_dequant): what these tests check bit for bit;
    weights kept in fp8: tests/unit/models/test_quant_fp8_checkpoint.py."""
    return build_model(ModelConfig.from_pretrained(path),
                       LoadConfig(path=path, dtype=dtype, quantization="fp8_dequant"), **kw)


def _assert_params_equal(a, b):
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for n in pa:
        assert pa[n].dtype == pb[n].dtype and torch.equal(pa[n], pb[n]), n


def test_reader_view_is_logical(ckpts):
    where, opened = checkpoint_files(ckpts["fp8"])
    reader = CheckpointReader(where, opened, pin=False)
    try:
        assert not any(n.endswith("_scale_inv") for n in where)
        assert set(where) == set(ckpts["deq_tensors"])
        n = "model.layers.0.block_sparse_moe.experts.1.w2.weight"
        assert reader.shape(n) == (48, 72) and where.scales[n][0] == n + "_scale_inv"
        out = torch.empty(48, 72, dtype=torch.bfloat16)
        reader.read(n, out)
        assert torch.equal(out, ckpts["deq_tensors"][n].to(torch.bfloat16))
        rows = torch.empty(40, 72)
        reader.read(n, rows, rows=(5, 45))
        assert torch.equal(rows, ckpts["deq_tensors"][n][5:45])
    finally:
        reader.close()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fp8_load_equals_dequantised_fp32_checkpoint(ckpts, dtype):
    _assert_params_equal(_build(ckpts["fp8"], dtype), _build(ckpts["deq"], dtype))


def test_tp_slice_of_fp8_equals_slice_of_dequantised(ckpts):
    """TP rank 1 of 2: q_proj rows 24..48 and k/v rows 12..24 start mid-block; o_proj is a
    column slice."""
    tp = ParallelContext(tp_rank=1, tp_size=2, all_reduce=lambda x: x)
    got = _build(ckpts["fp8"], par=tp, role="attention")
    full = dict(_build(ckpts["deq"]).named_parameters())
    n_sharded = 0
    for n, p in got.named_parameters():
        if p.numel() == 0:  # the attention role holds no expert slots
            continue
        want = full[n]
        shard = getattr(p, "tp_shard", None)
        if shard is not None:
            n_sharded += 1
            want = want.narrow(shard[0], shard[1].start, shard[1].stop - shard[1].start)
        assert torch.equal(p, want), n
    assert n_sharded >= 8  # q, k, v, o of both layers
    _assert_params_equal(got, _build(ckpts["deq"], par=tp, role="attention"))


def test_llm_greedy_matches_transformers_on_dequantised_weights(ckpts):
    import transformers

    from megainfer import LLM, SamplingParams
    from parity_util import hf_greedy
    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpts["deq"]).eval()
    assert getattr(hf.config, "quantization_config", None) is None
    prompts = [[5, 17, 33, 9], [100, 3, 250, 7, 7, 42, 11], [1]]
    llm = LLM(ckpts["fp8"], max_model_len=64, max_num_seqs=4,
              overrides=["model.quantization=fp8_dequant"])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert list(o.outputs[0].token_ids) == hf_greedy(hf, p, 8), p


def test_fused_3d_fp8_experts(ckpts, tmp_path):
    """transformers' fused expert layout, quantised per expert: gate_up_proj [E, 144, 48] with
    gate_up_proj_scale_inv [E, 5, 2] (144 = 4.5 blocks)."""
    fp8, deq = dict(ckpts["fp8_tensors"]), dict(ckpts["deq_tensors"])
    for layer in range(2):
        p = f"model.layers.{layer}.block_sparse_moe.experts"
        q = f"model.layers.{layer}.mlp.experts"
        src = ckpts["src_tensors"]
        gu = torch.stack([torch.cat([src[f"{p}.{e}.{w}.weight"] for w in ("w1", "w3")])
                          for e in range(4)])
        dn = torch.stack([src[f"{p}.{e}.w2.weight"] for e in range(4)])
        for d in (fp8, deq):
            for e in range(4):
                for w in ("w1", "w2", "w3"):
                    d.pop(f"{p}.{e}.{w}.weight")
                    d.pop(f"{p}.{e}.{w}.weight_scale_inv", None)
        for part, w in (("gate_up_proj", gu), ("down_proj", dn)):
            qw, s = _quantize(w.float(), BLOCK)
            assert s.shape == (4, _cdiv(w.shape[1], 32), _cdiv(w.shape[2], 32))
            fp8[f"{q}.{part}"], fp8[f"{q}.{part}_scale_inv"] = qw, s
            deq[f"{q}.{part}"] = torch.stack([_naive(qw[e], s[e], BLOCK) for e in range(4)])
    a = _write(tmp_path / "fp8", fp8, ckpts["config"], QCFG)
    b = _write(tmp_path / "deq", deq, ckpts["config"], None)
    _assert_params_equal(_build(a, "bfloat16"), _build(b, "bfloat16"))
    # an expert-role rank holding replicas reads single rows (experts) of the fused tensors
    kw = dict(role="experts", expert_slots=[[1, 2]] * 2, phy2log=[[0, 3, 1, 2]] * 2)
    _assert_params_equal(_build(a, **kw), _build(b, **kw))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_fp8_load_matches_host(ckpts):
    tp = ParallelContext(tp_rank=1, tp_size=2, all_reduce=lambda x: x)
    host = _build(ckpts["fp8"], "bfloat16", par=tp)
    dev = _build(ckpts["fp8"], "bfloat16", par=tp, device="cuda")
    for (n, p), q in zip(host.named_parameters(), dev.parameters()):
        assert q.is_cuda and torch.equal(q.cpu(), p), n


def test_sharded_index_with_scales_in_other_files(ckpts, tmp_path):
    dst = tmp_path / "sharded"
    dst.mkdir()
    shutil.copy(os.path.join(ckpts["fp8"], "config.json"), dst)
    t = ckpts["fp8_tensors"]
    weights = sorted(n for n in t if not n.endswith("_scale_inv"))
    scales = sorted(n for n in t if n.endswith("_scale_inv"))
    wmap = {}
    for fn, names in (("model-00001-of-00002.safetensors", weights),
                      ("model-00002-of-00002.safetensors", scales)):
        save_file({n: t[n] for n in names}, str(dst / fn))
        wmap.update({n: fn for n in names})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wmap}))
    _assert_params_equal(_build(str(dst)), _build(ckpts["deq"]))


# ----------------------------------------------------------------------------- bad checkpoints
W = "model.layers.1.self_attn.q_proj.weight"
S = W + "_scale_inv"


def _bad(ckpts, tmp_path, mutate, quant=QCFG):
    t = dict(ckpts["fp8_tensors"])
    mutate(t)
    return _write(tmp_path / "bad", t, ckpts["config"], quant)


def _set(name, value):
    def mutate(t):
        t[name] = value
    return mutate


def _nan_at(name, i, j, v):
    def mutate(t):
        s = t[name].clone()
        s[i, j] = v
        t[name] = s
    return mutate


@pytest.mark.parametrize("mutate,err,words", [
    (lambda t: t.pop(S), MissingTensorError, [W, "block scale", S]),
    (_set(S, torch.ones(1, 2)), ShapeMismatchError, [S, W, "[2, 2]"]),
    (_set(S, torch.ones(2, 2, 1)), ShapeMismatchError, [S, W]),
    (_nan_at(S, 0, 1, float("nan")), CorruptCheckpointError, [S, "nan"]),
    (_nan_at(S, 1, 0, 0.0), CorruptCheckpointError, [S, "not finite and positive"]),
    (_nan_at(S, 1, 1, float("inf")), CorruptCheckpointError, [S, "inf"]),
    (_set("model.layers.0.self_attn.q_proj.bias_scale_inv", torch.ones(1)),
     UnexpectedTensorError, ["q_proj.bias_scale_inv", "without its weight"]),
    (_set("model.norm.weight_scale_inv", torch.ones(1, 2)), CorruptCheckpointError,
     ["model.norm.weight", "not float8"]),
    (_set(S, torch.ones(2, 2, dtype=torch.int32)), CorruptCheckpointError, [S, "int32"]),
    (_set(W, torch.zeros(48, 48, dtype=torch.float8_e5m2)), CorruptCheckpointError,
     [W, "fmt='e4m3'"]),
], ids=["missing-scale", "short-scale", "3d-scale", "nan", "zero", "inf", "orphan",
        "scale-on-bf16", "int-scale", "fmt-mismatch"])
def test_bad_fp8_checkpoint_raises_typed_error(ckpts, tmp_path, mutate, err, words):
    path = _bad(ckpts, tmp_path, mutate)
    with pytest.raises(err) as ei:
        _build(path)
    msg = str(ei.value)
    for w in words:
        assert w in msg, (w, msg)


def test_fp8_weights_without_quantization_config(ckpts, tmp_path):
    path = _bad(ckpts, tmp_path, lambda t: None, quant=None)
    with pytest.raises(ConfigMismatchError, match="quantization_config"):
        _build(path)


def test_unknown_quant_method_fails_before_any_weight(ckpts, tmp_path):
    path = _bad(ckpts, tmp_path, lambda t: None, quant=dict(QCFG, quant_method="awq"))
    with pytest.raises(ConfigError, match=r"config\.json quantization_config\.quant_method='awq'"):
        _build(path)


DEEPSEEK_QUANTISED = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj",
                      "gate_proj", "up_proj", "down_proj")  # not the router, norms, embeddings


def test_deepseek_v3_fp8_greedy_matches_transformers_on_dequantised_weights(tmp_path):
    """DeepSeek-V3 as DeepSeek ships it: every linear weight of attention, dense MLPs, shared
    and routed experts in float8 with [32, 32] block scales (kv_a_proj_with_mqa's 40 rows end
    in an edge block of 8, as the real 576 rows do at 128), against HF on the dequantised
    weights."""
    import transformers

    from megainfer import LLM, SamplingParams
    from megainfer.tools.make_tiny import make_tiny
    from parity_util import hf_greedy
    src = make_tiny("deepseek_v3", str(tmp_path / "src"), seed=1, q_lora_rank=24)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    fp8, deq = {}, {}
    for n, w in load_file(os.path.join(src, "model.safetensors")).items():
        if n.endswith(".weight") and any(k in n for k in DEEPSEEK_QUANTISED):
            q, s = _quantize(w.float(), BLOCK)
            fp8[n], fp8[n + "_scale_inv"] = q, s
            deq[n] = dequantize_blockwise(q, s, BLOCK)
        else:
            fp8[n] = deq[n] = w
    assert fp8["model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"].shape[0] == 2
    assert any(".mlp.experts." in n and n.endswith("_scale_inv") for n in fp8)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        _write(tmp_path / "deq", deq, config, None)).eval()
    llm = LLM(_write(tmp_path / "fp8", fp8, config, QCFG), max_model_len=128, max_num_seqs=4,
              max_num_batched_tokens=32, overrides=["model.quantization=fp8_dequant"])
    prompts = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (70, 5)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert list(o.outputs[0].token_ids) == hf_greedy(hf, p, 8), len(p)
