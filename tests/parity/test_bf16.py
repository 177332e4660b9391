"""bf16 done right: RoPE tables stay float32 whatever the model dtype, and a bf16 model far
into its context (positions above 2,000) stays close to Hugging Face's bf16 model."""
import pytest
import torch

from megainfer import LLM, SamplingParams
from megainfer.config import LoadConfig, ModelConfig
from megainfer.models import build_model
from megainfer.tools.make_tiny import make_tiny
from parity_util import check_greedy_close


@pytest.fixture(scope="module")
def long_ckpt(tmp_path_factory):
    return make_tiny("mixtral", str(tmp_path_factory.mktemp("long") / "mixtral"), seed=3,
                     max_pos=4096)


def test_rope_tables_stay_float32_in_a_bf16_model(long_ckpt):
    cfg = ModelConfig.from_pretrained(long_ckpt)
    model = build_model(cfg, LoadConfig(path=long_ckpt, dtype="bfloat16"))
    rot = model.layers[0].self_attn.rotary
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert rot.inv_freq.dtype == torch.float32
    # the phase at position 3000 against a float64 computation: bf16 inverse frequencies
    # (8 mantissa bits) would be off by up to ~3000 * 2**-9 ~ 6 radians here
    D = cfg.head_dim
    exact = 1.0 / (cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    q = torch.zeros(1, 1, D, dtype=torch.bfloat16)
    q[..., : D // 2] = 1  # rotated: cos in the first half, sin in the second
    k = q.clone()
    pos = torch.tensor([3000])
    qr, _ = rot(q, k, pos)
    want = torch.cos(3000 * exact)
    assert (qr[0, 0, : D // 2].double() - want).abs().max() < 2e-2


def test_bf16_engine_stays_close_to_hf_past_position_2000(long_ckpt):
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(long_ckpt, dtype=torch.bfloat16).eval()
    llm = LLM(long_ckpt, dtype="bfloat16", device="cpu", max_model_len=4096,
              max_num_batched_tokens=1024, kv_cache_memory_gib=0.25)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (2100, 2400)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)
    matched = [check_greedy_close(o.outputs[0].token_ids, hf, p, k=5)
               for o, p in zip(outs, prompts)]
    assert all(len(o.outputs[0].token_ids) == 12 for o in outs)
    assert max(matched) >= 4, f"bf16 greedy left HF's argmax almost at once: {matched}"
