"""FP8 block-quantised checkpoints kept in fp8 (``model.quantization`` null or fp8): the
stored bytes and ``weight_scale_inv`` of every quantised linear and expert are the
checkpoint's own (bytes checked), the model matches its dequantised twin (the reference that
quantises activations the same way) and stays within the top-k of transformers on the
dequantised weights; TP slices hold whole blocks or are refused. Dequantised on load
(``fp8_dequant``): tests/unit/models/test_fp8_checkpoint.py."""
import os

import pytest
import torch
from safetensors.torch import load_file

from megainfer.config import ConfigError, LoadConfig, ModelConfig
from megainfer.models import ParallelContext, build_model
from megainfer.models.quant_load import weight_bytes_by_kind
from megainfer.models.quant_linear import QuantLinear

from quant_util import build, dequantised_twin, logits, make, write_dequantised, write_fp8

BLOCK = (32, 32)
PROMPT = [1, 5, 9, 33, 70, 4, 100, 17]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8keep")
    out = {}
    for fam in ("mixtral", "deepseek_v3"):
        src = make(fam, root / "src")
        out[fam] = (src, write_fp8(src, str(root / f"{fam}-fp8"), BLOCK))
    out["mixtral16"] = (out["mixtral"][0], write_fp8(out["mixtral"][0], str(root / "m16"), (16, 16)))
    return out


def _tensors(path):
    return load_file(os.path.join(path, "model.safetensors"))


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_kept_as_stored(ckpts, family, quantization):
    src, path = ckpts[family]
    t = _tensors(path)
    m = build(path, quantization=quantization)
    stored = 0
    for name, mod in m.named_modules():
        if isinstance(mod, QuantLinear):
            assert mod.fmt.block == BLOCK
            assert torch.equal(mod.weight.view(torch.uint8), t[name + ".weight"].view(torch.uint8))
            assert torch.equal(mod.weight_scale_inv, t[name + ".weight_scale_inv"])
            stored += mod.weight.numel() + 4 * mod.weight_scale_inv.numel()
        elif getattr(mod, "weight_format", None) is not None:
            layer = int(name.split(".")[2])
            for e in range(mod.gate_up_proj.shape[0]):
                g, u, d = _expert_names(family, layer, e)
                assert torch.equal(mod.gate_up_proj[e].view(torch.uint8),
                                   torch.cat([t[g], t[u]]).view(torch.uint8))
                assert torch.equal(mod.gate_up_proj_scale_inv[e],
                                   torch.cat([t[g + "_scale_inv"], t[u + "_scale_inv"]]))
                assert torch.equal(mod.down_proj[e].view(torch.uint8), t[d].view(torch.uint8))
            stored += sum(p.numel() * p.element_size() for p in mod.parameters())
    assert weight_bytes_by_kind(m)["quantised"] == stored > 0
    if family == "deepseek_v3":  # kv_b_proj dequantised into the model dtype
        assert m.layers[0].self_attn.kv_b_proj.weight.dtype == torch.float32
    got, ref = logits(m, PROMPT), logits(dequantised_twin(m, path), PROMPT)
    assert torch.allclose(got, ref, atol=2e-4, rtol=1e-4), (got - ref).abs().max()


def _expert_names(family, layer, e):
    if family == "mixtral":
        b = f"model.layers.{layer}.block_sparse_moe.experts.{e}"
        return f"{b}.w1.weight", f"{b}.w3.weight", f"{b}.w2.weight"
    b = f"model.layers.{layer}.mlp.experts.{e}"
    return f"{b}.gate_proj.weight", f"{b}.up_proj.weight", f"{b}.down_proj.weight"


def test_greedy_within_topk_of_transformers(ckpts, tmp_path):
    """Kept fp8 (weights and per-token-group activations) against HF on the dequantised
    weights: equal to HF's argmax until a divergence, and there within HF's top 3."""
    import transformers

    from megainfer import LLM, SamplingParams
    from parity_util import check_greedy_close
    _, path = ckpts["deepseek_v3"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        write_dequantised(path, str(tmp_path / "deq"))).eval()
    llm = LLM(path, max_model_len=64, max_num_seqs=2)
    outs = llm.generate([{"prompt_token_ids": PROMPT}],
                        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)
    check_greedy_close(list(outs[0].outputs[0].token_ids), hf, PROMPT, k=3)


def test_tp_slices_hold_whole_blocks(ckpts):
    src, path = ckpts["mixtral16"]
    cfg = ModelConfig.from_pretrained(path)
    whole = build(path)
    par = ParallelContext(1, 2, all_reduce=lambda x: x)
    r1 = build_model(cfg, LoadConfig(path=path), par=par, role="attention")
    a, b = whole.layers[0].self_attn, r1.layers[0].self_attn
    for proj in ("q_proj", "k_proj", "v_proj"):  # rows: the second half of each
        w, s = getattr(a, proj).weight, getattr(a, proj).weight_scale_inv
        n = w.shape[0] // 2
        assert torch.equal(getattr(b, proj).weight.view(torch.uint8), w[n:].view(torch.uint8))
        assert torch.equal(getattr(b, proj).weight_scale_inv, s[n // 16:])
    w, s = a.o_proj.weight, a.o_proj.weight_scale_inv  # columns: the second half
    n = w.shape[1] // 2
    assert torch.equal(b.o_proj.weight.view(torch.uint8), w[:, n:].view(torch.uint8))
    assert torch.equal(b.o_proj.weight_scale_inv, s[:, n // 16:])


def test_tp_slice_off_blocks_refused_before_loading(ckpts):
    _, path = ckpts["mixtral"]  # k_proj: 32 rows, 16 per rank, blocks of 32
    par = ParallelContext(0, 2, all_reduce=lambda x: x)
    with pytest.raises(ConfigError, match=r"deploy.attention_tp: .*k_proj.weight is split at "
                                          r"rows \[0, 16\) of 32, not on whole 32-wide blocks"):
        build_model(ModelConfig.from_pretrained(path), LoadConfig(path=path), par=par)


def test_expert_halves_off_blocks_refused(ckpts, tmp_path):
    src, _ = ckpts["mixtral"]  # intermediate 64: blocks of 48 rows split gate from up
    path = write_fp8(src, str(tmp_path / "b48"), (48, 32))
    with pytest.raises(ConfigError, match=r"moe_intermediate_size=64 .* 48-row .*fp8_dequant"):
        build(path)
    m = build(path, quantization="int8")  # requantised from the dequantised values: fine
    assert m.layers[0].mlp.experts.gate_up_proj.dtype == torch.int8
