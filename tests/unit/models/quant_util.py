"""Helpers of the weight-format tests: tiny checkpoints per family at shapes every format can
store, a model's dequantised twin (the reference that quantises the same way), FP8 checkpoints
written from a plain one."""
import contextlib
import json
import os

import torch
from safetensors.torch import load_file, save_file

from megainfer.config import LoadConfig, ModelConfig
from megainfer.kernels import cpu_gemm
from megainfer.kernels.cpu_qgemm import dequantize_fp8_blocks
from megainfer.kernels.weight_quant import quantize_act_fp8, quantize_fp8
from megainfer.models import build_model
from megainfer.models.quant_linear import QuantLinear

# int4's CPU layout needs out_features % 16 == 0 and in_features % group == 0 (group 32 here):
# DeepSeek's kv_a_proj_with_mqa is kv_lora_rank + qk_rope_head_dim = 40 + 8 rows
SHAPES = {"mixtral": {}, "qwen3_moe": {}, "qwen2_moe": {"shared_inter": 96},
          "deepseek_v3": {"kv_lora_rank": 40}}
FP8_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj",
             "kv_a_proj_with_mqa", "kv_b_proj", "gate_proj", "up_proj", "down_proj",
             ".w1.", ".w2.", ".w3.")


def make(family, root, seed=1):
    from megainfer.tools.make_tiny import make_tiny
    return make_tiny(family, os.path.join(str(root), family), seed=seed, **SHAPES[family])


def build(path, **load):
    return build_model(ModelConfig.from_pretrained(path), LoadConfig(path=path, **load))


def dequantised_twin(qmodel, path, dtype="float32"):
    """The same architecture unquantised in ``dtype``, with every kept-quantised weight of
    ``qmodel`` replaced by its dequantised values: plain F.linear and a per-token expert loop
    on them is the torch reference of the quantised compute paths. For fp8 the twin quantises
    each quantised GEMM's input per token per block-column group too (DeepSeek's activations),
    by a forward pre-hook on its linears and inside its expert loop."""
    twin = build(path, dtype=dtype, quantization="fp8_dequant")
    twin.fp8_inputs = {}  # id(weight) -> format whose activations its GEMM quantises
    mods = dict(twin.named_modules())
    with torch.no_grad():
        for name, m in qmodel.named_modules():
            if isinstance(m, QuantLinear):
                mods[name].weight.copy_(m.qweight.dequantize(twin.lm_head.weight.dtype))
                if m.fmt.name == "fp8":  # module calls (MLA) and cpu_gemm calls (logits())
                    mods[name].register_forward_pre_hook(_act_hook(m.fmt))
                    twin.fp8_inputs[id(mods[name].weight)] = m.fmt
            elif getattr(m, "weight_format", None) is not None:
                for part in ("gate_up_proj", "down_proj"):
                    getattr(mods[name], part).copy_(m.stored(part).dequantize())
                mods[name].forward = _expert_loop(mods[name], m.weight_format)
    return twin


def _actq(fmt):
    if fmt.name != "fp8":
        return lambda x: x
    return lambda x: quantize_act_fp8(x, fmt.block[1], fmt.fp8_dtype)


def _act_hook(fmt):
    q = _actq(fmt)
    return lambda mod, args: (q(args[0].reshape(-1, args[0].shape[-1])).view(args[0].shape),)


def _expert_loop(ex, fmt):
    """Every expert of every token, one at a time: out[t] = sum_j w[t, j] * down(silu(gate) *
    up), the GEMM inputs quantised as ``fmt`` quantises them."""
    q = _actq(fmt)

    def forward(x, topk_weights, topk_ids):
        out = torch.zeros(x.shape, dtype=torch.float32)
        N = ex.down_proj.shape[2]
        for t in range(x.shape[0]):
            for j in range(topk_ids.shape[1]):
                e = int(ex.expert_map[int(topk_ids[t, j])])
                g = q(x[t:t + 1]) @ ex.gate_up_proj[e].t()  # [1, 2N]
                a = torch.nn.functional.silu(g[:, :N]) * g[:, N:]
                out[t] += float(topk_weights[t, j]) * (q(a) @ ex.down_proj[e].t())[0].float()
        return out.to(x.dtype)
    return forward


def logits(model, ids):
    """Final logits [len(ids), V] of one uncached sequence. A twin with fp8 inputs runs its
    ``cpu_gemm`` linears with those inputs quantised (one weight at a time)."""
    ids = torch.tensor(ids)
    fp8 = getattr(model, "fp8_inputs", None)
    with torch.no_grad(), contextlib.ExitStack() as stack:
        if fp8:
            stack.enter_context(_fp8_cpu_gemm(fp8))
        return model.compute_logits(model(ids, torch.arange(len(ids))))


@contextlib.contextmanager
def _fp8_cpu_gemm(fp8: dict):
    linear, split = cpu_gemm.linear, cpu_gemm.linear_split

    def q_linear(x, w, bias=None, index=None, kind="dense"):
        if id(w) in fp8:
            x = _actq(fp8[id(w)])(x.reshape(-1, x.shape[-1])).view(x.shape)
        return linear(x, w, bias, index, kind)

    def q_split(x, ws, biases=None, kind="dense"):
        biases = biases or [None] * len(ws)
        return [q_linear(x, w, b) for w, b in zip(ws, biases)]
    cpu_gemm.linear, cpu_gemm.linear_split = q_linear, q_split
    try:
        yield
    finally:
        cpu_gemm.linear, cpu_gemm.linear_split = linear, split


def write_fp8(src, dst, block, names=FP8_NAMES):
    """``src`` with every linear weight matching ``names`` (and lm_head/embeddings not) as
    float8_e4m3fn + ``weight_scale_inv`` on a ``block`` grid, and its quantization_config."""
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                  "activation_scheme": "dynamic",
                                  "weight_block_size": list(block)}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    out = {}
    for n, w in load_file(os.path.join(src, "model.safetensors")).items():
        if n.endswith(".weight") and any(k in n for k in names) and ".gate." not in n:
            out[n], out[n + "_scale_inv"] = quantize_fp8(w.float(), block)
        else:
            out[n] = w
    save_file(out, os.path.join(dst, "model.safetensors"))
    return dst


def write_dequantised(src, dst):
    """An FP8 checkpoint ``src`` as a plain float32 one (every float8 weight times its block
    scales, no quantization_config): what transformers loads as the oracle."""
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    block = tuple(cfg.pop("quantization_config")["weight_block_size"])
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    t = load_file(os.path.join(src, "model.safetensors"))
    out = {n: dequantize_fp8_blocks(w, t[n + "_scale_inv"], block, torch.float32)
           if n + "_scale_inv" in t else w for n, w in t.items() if not n.endswith("_scale_inv")}
    save_file(out, os.path.join(dst, "model.safetensors"))
    return dst
