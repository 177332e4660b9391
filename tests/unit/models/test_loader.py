"""Checkpoint loading: layouts, role filters, tensor parallel slices, and every bad case."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from megainfer.config import ConfigError, LoadConfig, ModelConfig
from megainfer.models import ParallelContext, build_model
from megainfer.models.loader import (ConfigMismatchError, CorruptCheckpointError,
                                     MissingTensorError, ShapeMismatchError, UnexpectedTensorError)
from tp_threads import run_tp_threads


def _copy_ckpt(src, dst, mutate=None):
    """Copy a checkpoint; mutate(tensors dict) may edit it before writing."""
    shutil.copytree(src, dst)
    if mutate:
        f = os.path.join(dst, "model.safetensors")
        t = load_file(f)
        mutate(t)
        save_file(t, f)
    return str(dst)


def _load(path, **kw):
    return build_model(ModelConfig.from_pretrained(path), LoadConfig(path=path), **kw)


def _logits(model, n=9):
    ids = torch.arange(n) * 7 % model.config.vocab_size
    with torch.no_grad():
        return model.compute_logits(model(ids, torch.arange(n)))


def test_fused_layout_loads_same_weights(tiny_ckpts, tmp_path):
    src = tiny_ckpts[("qwen3_moe", "base")]

    def fuse(t):
        for layer in range(2):
            p = f"model.layers.{layer}.mlp.experts"
            gu = [torch.cat([t.pop(f"{p}.{e}.gate_proj.weight"), t.pop(f"{p}.{e}.up_proj.weight")])
                  for e in range(4)]
            dn = [t.pop(f"{p}.{e}.down_proj.weight") for e in range(4)]
            t[f"{p}.gate_up_proj"], t[f"{p}.down_proj"] = torch.stack(gu), torch.stack(dn)
    fused = _copy_ckpt(src, tmp_path / "fused", fuse)
    torch.testing.assert_close(_logits(_load(fused)), _logits(_load(src)), atol=0, rtol=0)


def test_sharded_index_checkpoint(tiny_ckpts, tmp_path):
    src = tiny_ckpts[("mixtral", "base")]
    dst = tmp_path / "sharded"
    dst.mkdir()
    shutil.copy(os.path.join(src, "config.json"), dst)
    t = load_file(os.path.join(src, "model.safetensors"))
    names = sorted(t)
    wmap = {}
    for i, part in enumerate((names[::2], names[1::2])):
        fn = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: t[n] for n in part}, str(dst / fn))
        wmap.update({n: fn for n in part})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wmap}))
    torch.testing.assert_close(_logits(_load(str(dst))), _logits(_load(src)), atol=0, rtol=0)


def test_expert_role_loads_only_its_slots_with_replicas(tiny_ckpts):
    src = tiny_ckpts[("mixtral", "base")]
    full = _load(src)
    # 6 physical slots over 4 logical experts; this rank holds slots 3..5
    phy2log = [[0, 1, 2, 3, 1, 2]] * 2
    shard = _load(src, role="experts", expert_slots=[[3, 4, 5]] * 2, phy2log=phy2log)
    assert not hasattr(shard.model, "embed_tokens") and not hasattr(shard, "lm_head")
    for layer in range(2):
        ex, ref = shard.layers[layer].mlp.experts, full.layers[layer].mlp.experts
        assert ex.slots == [3, 4, 5] and ex.expert_map.tolist() == [-1, -1, -1, 0, 1, 2]
        for local, logical in enumerate((3, 1, 2)):
            assert torch.equal(ex.gate_up_proj[local], ref.gate_up_proj[logical])
            assert torch.equal(ex.down_proj[local], ref.down_proj[logical])


def test_attention_role_has_no_expert_weights(tiny_ckpts):
    m = _load(tiny_ckpts[("qwen2_moe", "base")], role="attention")
    assert all(l.mlp.experts.gate_up_proj.numel() == 0 for l in m.layers)
    assert m.layers[0].mlp.shared_expert.gate_proj.weight.abs().sum() > 0


def test_dummy_weights_identical_across_roles():
    cfg = ModelConfig.from_hf_dict(json.loads(json.dumps(dict(
        model_type="mixtral", vocab_size=64, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        intermediate_size=48))))
    load = LoadConfig(load_format="dummy", seed=3)
    full = build_model(cfg, load)
    ex = build_model(cfg, load, role="experts", expert_slots=[[2, 3]] * 2)
    att = build_model(cfg, load, role="attention")
    assert torch.equal(ex.layers[1].mlp.experts.down_proj[0], full.layers[1].mlp.experts.down_proj[2])
    assert torch.equal(att.model.embed_tokens.weight, full.model.embed_tokens.weight)
    assert torch.equal(att.layers[0].self_attn.q_proj.weight, full.layers[0].self_attn.q_proj.weight)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_tensor_parallel_heads_match_single(tiny_ckpts, family):
    """Two TP ranks as threads with a real sum all-reduce give the single-rank logits."""
    src = tiny_ckpts[(family, "base")]
    want = _logits(_load(src))
    outs = run_tp_threads(
        lambda rank, all_reduce: _logits(_load(src, par=ParallelContext(rank, 2, all_reduce))))
    for o in outs:
        torch.testing.assert_close(o, want, atol=1e-5, rtol=1e-5)


def _drop(name):
    return lambda t: t.pop(name)


def _add(name):
    return lambda t: t.__setitem__(name, torch.zeros(3))


def _reshape(name):
    return lambda t: t.__setitem__(name, t[name][:-1].clone())


BAD = [
    ("missing", _drop("model.layers.1.self_attn.k_proj.weight"), MissingTensorError, "k_proj"),
    ("missing_expert", _drop("model.layers.0.block_sparse_moe.experts.3.w3.weight"),
     MissingTensorError, "expert 3 up"),
    ("extra", _add("model.layers.0.self_attn.rotary.weight"), UnexpectedTensorError, "rotary"),
    ("shape", _reshape("model.layers.0.block_sparse_moe.gate.weight"), ShapeMismatchError,
     "block_sparse_moe.gate.weight"),
    ("expert_shape", _reshape("model.layers.1.block_sparse_moe.experts.0.w2.weight"),
     ShapeMismatchError, "experts.0.w2"),
    ("extra_expert", lambda t: t.__setitem__("model.layers.0.block_sparse_moe.experts.7.w1.weight",
                                             torch.zeros(64, 64)), ConfigMismatchError, "num_experts=4"),
    ("extra_layer", lambda t: t.__setitem__("model.layers.5.input_layernorm.weight", torch.ones(64)),
     ConfigMismatchError, "num_hidden_layers=2"),
]


@pytest.mark.parametrize("case,mutate,err,words", BAD, ids=[b[0] for b in BAD])
def test_bad_checkpoint_errors_name_the_tensor_and_file(tiny_ckpts, tmp_path, case, mutate, err, words):
    bad = _copy_ckpt(tiny_ckpts[("mixtral", "base")], tmp_path / case, mutate)
    with pytest.raises(err) as e:
        _load(bad)
    assert words in str(e.value)
    if case != "missing" and case != "missing_expert":
        assert "model.safetensors" in str(e.value)


def test_truncated_file(tiny_ckpts, tmp_path):
    bad = _copy_ckpt(tiny_ckpts[("qwen3_moe", "base")], tmp_path / "trunc")
    f = os.path.join(bad, "model.safetensors")
    size = os.path.getsize(f)
    with open(f, "r+b") as fh:
        fh.truncate(size // 2)
    with pytest.raises(CorruptCheckpointError, match="model.safetensors"):
        _load(bad)


def test_no_safetensors_and_bad_config(tmp_path):
    with pytest.raises(ConfigError, match="config.json"):
        ModelConfig.from_pretrained(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ConfigError, match="model_type"):
        ModelConfig.from_pretrained(str(tmp_path))
    with pytest.raises(ConfigError, match="model.load_format"):
        LoadConfig(load_format="pickle")
    with pytest.raises(ConfigError, match="model.path"):
        LoadConfig(path=str(tmp_path / "nowhere"))
