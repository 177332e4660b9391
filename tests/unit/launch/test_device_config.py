"""Device, dtype and attention-backend selection: defaults, the Hydra keys, and bad settings
refused with a ConfigError naming the key before any weight is read."""
import shutil

import pytest
import torch
from hydra import compose, initialize_config_module

from megainfer import LLM
from megainfer.config import ConfigError, DeviceConfig, ModelConfig
from megainfer.engine.cuda_graphs import graph_batch_sizes
from megainfer.engine.job_doors import settings_from_config
from megainfer.models.attention import AttentionMetadata, to_device_once

NO_CUDA = not torch.cuda.is_available()


def settings(*overrides, world=1):
    with initialize_config_module(config_module="megainfer.conf", version_base=None):
        cfg = compose("config", overrides=list(overrides))
    return settings_from_config(cfg, world)


def broken_ckpt(tiny_ckpts, tmp_path):
    """A checkpoint whose config.json is fine and whose weights cannot be read: an error about
    the settings must come before any attempt to read them."""
    d = tmp_path / "broken"
    shutil.copytree(tiny_ckpts[("mixtral", "base")], d)
    for f in d.glob("*.safetensors"):
        f.write_bytes(b"not a safetensors file")
    return str(d)


def test_defaults_follow_the_device():
    dev = DeviceConfig.resolve()
    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert dev.device == want and dev.attention_backend == ("triton" if want == "cuda" else "torch")
    assert dev.default_dtype() == ("bfloat16" if want == "cuda" else "float32")
    assert dev.cuda_graphs == (want == "cuda")
    s = settings()
    assert s.device.device == want and s.load.dtype == dev.default_dtype()


@pytest.mark.skipif(not NO_CUDA, reason="checks the refusal on a machine without CUDA")
def test_cuda_without_a_gpu_is_refused_before_loading(tiny_ckpts, tmp_path):
    path = broken_ckpt(tiny_ckpts, tmp_path)
    with pytest.raises(ConfigError, match=r"deploy.device='cuda'.*no CUDA device"):
        LLM(path, device="cuda")
    with pytest.raises(ConfigError, match=r"deploy.device='cuda'"):
        settings("deploy.device=cuda", f"model.path={path}")


@pytest.mark.parametrize("kw,match", [
    (dict(attention_backend="flash"), r"model.attention_backend='flash': must be one of torch, triton"),
    (dict(dtype="float64"), r"model.dtype='float64'"),
    (dict(device="tpu"), r"deploy.device='tpu'"),
])
def test_bad_llm_settings_name_the_key(tiny_ckpts, tmp_path, kw, match):
    with pytest.raises(ConfigError, match=match):
        LLM(broken_ckpt(tiny_ckpts, tmp_path), **kw)


def test_bad_hydra_keys_name_the_key():
    with pytest.raises(ConfigError, match="model.attention_backend='flash'"):
        settings("model.attention_backend=flash")
    with pytest.raises(ConfigError, match="engine.cuda_graphs='sometimes'"):
        settings("engine.cuda_graphs=sometimes")
    with pytest.raises(ConfigError, match="model.dtype='int8'"):
        settings("model.dtype=int8")
    s = settings("model.dtype=bfloat16", "model.attention_backend=torch", "deploy.device=cpu")
    assert s.load.dtype == "bfloat16" and s.device.attention_backend == "torch"


def test_distributed_modes_stay_on_cpu():
    s = settings(world=3)  # deploy=auto: 1 attention + 2 expert ranks
    assert s.deploy.mode == "disaggregated" and s.device.device == "cpu"


def test_triton_backend_limits_are_checked_up_front(monkeypatch):
    cfg = ModelConfig(family="mixtral", vocab_size=64, hidden_size=64, num_layers=1, num_heads=1,
                      num_kv_heads=1, head_dim=320, num_experts=2, top_k=1,
                      moe_intermediate_size=32)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ConfigError, match="head_dim 1..256, this model has 320"):
        LLM(cfg, attention_backend="triton", device="cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ConfigError, match="only under the interpreter"):
        DeviceConfig.resolve("cpu", "triton")


def test_graph_batch_sizes_cover_every_batch():
    sizes = graph_batch_sizes(64)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 64 and 48 in sizes
    assert graph_batch_sizes(1) == [1] and graph_batch_sizes(5) == [1, 2, 4, 5]
    for s in range(1, 65):
        assert any(b >= s for b in sizes)


def test_metadata_and_extras_come_through_one_copy():
    ids = torch.tensor([5, 6, 7, 9], dtype=torch.long)
    meta, (moved,) = AttentionMetadata.build_with([3, 1], [0, 4], [[2], [0, 1]], 4, "cpu", [ids])
    assert moved is ids and meta.max_query_len == 3 and meta.query_starts_list == [0, 3, 4]
    assert meta.decode_seqs.tolist() == [1] and meta.decode_rows.tolist() == [3]
    assert meta.slot_mapping.tolist() == [8, 9, 10, 4 + 0]
    parts = [torch.arange(3), torch.arange(6).view(2, 3)]
    assert [t.tolist() for t in to_device_once(parts, "cpu")] == \
        [p.tolist() for p in parts]


@pytest.mark.gpu
def test_one_copy_to_cuda_keeps_shapes():
    parts = [torch.arange(3), torch.arange(6).view(2, 3), torch.zeros(0, dtype=torch.long)]
    out = to_device_once(parts, "cuda")
    assert all(o.is_cuda and o.shape == p.shape for o, p in zip(out, parts))
    assert [o.cpu().tolist() for o in out] == [p.tolist() for p in parts]


def test_graph_rows_pack_one_decode_step(monkeypatch):
    """The host side of a graph replay (runs on CPU with the graph stubbed): one row per
    sequence (token, position, slot, length, block table), padded rows write and read nothing."""
    from megainfer.engine.cuda_graphs import DecodeGraphs
    dg = DecodeGraphs.__new__(DecodeGraphs)
    dg.block_size, dg.W, dg.sizes = 4, 5, [1, 2, 4, 8]
    dg.rows = torch.full((8, 9), 99, dtype=torch.long)
    seen = {}

    class Replay:
        def replay(self):
            seen["rows"] = dg.rows[:4].clone()
    dg.graphs = {4: (Replay(), torch.arange(12.0).view(4, 3))}
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)  # no CUDA here
    logits = dg.run([7, 8, 9], [5, 0, 12], [[3, 4], [1], [2, 5, 6, 9]])
    assert logits.shape == (3, 3)
    assert seen["rows"].tolist() == [[7, 5, 4 * 4 + 1, 6, 3, 4, 0, 0, 0],
                                     [8, 0, 1 * 4 + 0, 1, 1, 0, 0, 0, 0],
                                     [9, 12, 9 * 4 + 0, 13, 2, 5, 6, 9, 0],
                                     [0, 0, -1, 0, 0, 0, 0, 0, 0]]
    assert dg.fits([1, 1, 1], [[1], [2, 3], [4]]) and not dg.fits([2, 1], [[1], [2]])
    assert not dg.fits([1] * 9, [[1]] * 9) and not dg.fits([1], [[1] * 6])
