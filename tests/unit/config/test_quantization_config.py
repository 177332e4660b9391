"""``model.quantization`` / ``model.quantization_group_size`` through the config tree: the
dataclass's checks naming the field, the launcher's YAML and LLM's overrides reaching the
loader, and the device refusal before any weight is read."""
import types

import pytest
from megainfer import LLM, SamplingParams
from megainfer.config import ConfigError, DeviceConfig, LoadConfig, ModelConfig
from megainfer.config.llm_args import ARG_KEYS, llm_tree

TINY = ModelConfig(family="mixtral", vocab_size=300, hidden_size=64, num_layers=1, num_heads=2,
                   num_kv_heads=1, head_dim=32, num_experts=2, top_k=1,
                   moe_intermediate_size=64, max_position_embeddings=64)


def test_values_checked_naming_the_key():
    for q in (None, "fp8", "int8", "int4", "fp8_dequant"):
        assert LoadConfig(load_format="dummy", quantization=q).quantization == q
    with pytest.raises(ConfigError, match=r"^model.quantization='q4_k': must be null, fp8, int8, "
                                          r"int4, fp8_dequant"):
        LoadConfig(load_format="dummy", quantization="q4_k")
    with pytest.raises(ConfigError, match=r"^model.quantization_group_size=48: must be one of "
                                          r"32, 64, 128, 256"):
        LoadConfig(load_format="dummy", quantization_group_size=48)
    with pytest.raises(ConfigError, match="model.quantization_group_size=True"):
        LoadConfig(load_format="dummy", quantization_group_size=True)


def test_int4_refused_off_cpu_before_loading():
    cuda = types.SimpleNamespace(device="cuda", attention_backend="torch")
    with pytest.raises(ConfigError, match=r"model.quantization='int4': .*cpu only, not "
                                          r"deploy.device=cuda; use model.quantization=int8 or fp8"):
        DeviceConfig.check_model(cuda, TINY, "bfloat16", "int4")
    DeviceConfig.check_model(cuda, TINY, "bfloat16", "int8")  # the dequantising paths run there
    DeviceConfig().check_model(TINY, "float32", "int4")


def test_llm_argument_maps_to_the_key():
    assert ARG_KEYS["quantization"] == "model.quantization"
    tree, origin = llm_tree({"quantization": "int8"})
    assert tree["model"]["quantization"] == "int8"
    assert origin["model.quantization"] == "quantization='int8'"


def test_launcher_and_llm_reach_the_loader(tmp_path, caplog):
    from hydra import compose, initialize_config_module

    from megainfer.engine.job_doors import settings_from_config
    from megainfer.tools.make_tiny import make_tiny
    path = make_tiny("qwen3_moe", str(tmp_path / "q3"), seed=1)
    with initialize_config_module(config_module="megainfer.conf", version_base=None):
        cfg = compose("config", overrides=[f"model.path={path}", "model.quantization=int4",
                                           "model.quantization_group_size=32"])
    s = settings_from_config(cfg, 1)
    assert (s.load.quantization, s.load.quantization_group_size) == ("int4", 32)
    with caplog.at_level("INFO", logger="megainfer.models"):
        llm = LLM(path, max_model_len=64, max_num_seqs=2,
                  overrides=["model.quantization=int8", "model.dtype=bfloat16"])
    assert "linear/expert weights in int8" in caplog.text  # the start-up line, per role
    assert "in bfloat16 (embeddings" in caplog.text
    out = llm.generate([{"prompt_token_ids": [1, 5, 9]}],
                       SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    with pytest.raises(ConfigError, match="model.quantization='nf4'"):
        LLM(path, overrides=["model.quantization=nf4"])
