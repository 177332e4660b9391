"""Write a tiny random checkpoint of one family with transformers' ``save_pretrained``.

    python -m megainfer.tools.make_tiny --family mixtral --out DIR [--experts 6 --top-k 3 ...]

Seeded, and initialised wider than HF's default (``initializer_range``) so that greedy argmax
margins sit well above float noise: tests compare greedy tokens across deploy modes.

With ``--chat-template`` (the default; ``--no-chat-template`` leaves it out) the checkpoint
also gets ``chat_template.jinja``, a minimal role-tagged template (``CHAT_TEMPLATE``), so
``LLM.chat`` and "messages" input lines run on it. The checkpoint has no tokenizer files:
megainfer reads its text as bytes (one token per byte), so the template is plain ASCII.
"""
from __future__ import annotations

import argparse
import os
from typing import Optional

# "<|user|>\nhi\n<|assistant|>\n": one tag line per message, the cue when asked
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")

FAMILY_CLASSES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
}


def deepseek_config_kwargs(*, vocab=256, hidden=64, layers=4, heads=4, experts=8, top_k=2,
                           inter=32, max_pos=256, q_lora_rank=None, kv_lora_rank=32,
                           qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_group=4,
                           topk_group=2, first_k_dense_replace=2, n_shared_experts=1,
                           routed_scaling_factor=2.5, yarn=True, norm_topk_prob=True,
                           init=0.1, family="deepseek_v3", **_ignored) -> dict:
    """A tiny DeepSeek-V3 (or V2: softmax group_limited_greedy routing): 2 dense + 2 MoE
    layers, groups that really select (8 experts in 4 groups, 2 kept, top-2), YaRN (factor 4 over an original context of 64, mscale != mscale_all_dim
    so both the cos/sin factor and the softmax mscale matter)."""
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if yarn:
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
                "mscale": 1.0, "mscale_all_dim": 0.8}
    kw = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=heads, n_routed_experts=experts,
                num_experts_per_tok=top_k, moe_intermediate_size=inter, intermediate_size=2 * inter,
                q_lora_rank=q_lora_rank, kv_lora_rank=kv_lora_rank,
                qk_nope_head_dim=qk_nope_head_dim, qk_rope_head_dim=qk_rope_head_dim,
                v_head_dim=v_head_dim, n_group=n_group, topk_group=topk_group,
                first_k_dense_replace=first_k_dense_replace, n_shared_experts=n_shared_experts,
                routed_scaling_factor=routed_scaling_factor, norm_topk_prob=norm_topk_prob,
                max_position_embeddings=max_pos, initializer_range=init, rope_parameters=rope,
                tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if family == "deepseek_v3":
        kw.update(rope_interleave=True)
    else:
        kw.update(topk_method="group_limited_greedy" if n_group > 1 else "greedy")
    return kw


def tiny_config_kwargs(family: str, *, vocab=256, hidden=64, layers=2, heads=4, kv_heads=2,
                       experts=4, top_k=2, inter=64, max_pos=512, norm_topk_prob=True,
                       shared_inter=96, mlp_only_layers=(), init=0.1) -> dict:
    kw = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
              num_attention_heads=heads, num_key_value_heads=kv_heads, num_experts_per_tok=top_k,
              max_position_embeddings=max_pos, initializer_range=init, tie_word_embeddings=False,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if family == "mixtral":
        kw.update(num_local_experts=experts, intermediate_size=inter)
    else:
        kw.update(num_experts=experts, moe_intermediate_size=inter, intermediate_size=2 * inter,
                  norm_topk_prob=norm_topk_prob, mlp_only_layers=list(mlp_only_layers),
                  decoder_sparse_step=1)
        if family == "qwen3_moe":
            kw.update(head_dim=hidden // heads)
        else:
            kw.update(shared_expert_intermediate_size=shared_inter)
    return kw


def make_tiny(family: str, out: str, seed: int = 0, chat_template: bool = True,
              tokenizer: Optional[str] = None, **shape) -> str:
    """Build, seed-initialise and save a tiny HF checkpoint of ``family`` into ``out`` (with
    ``chat_template``: and ``CHAT_TEMPLATE`` as its ``chat_template.jinja``). ``tokenizer``
    (``qwen3`` | ``deepseek_v3``): also a real byte-level BPE tokenizer with that chat style's
    special tokens and template (``tiny_tokenizer.py``; the style's template then replaces
    ``CHAT_TEMPLATE``); the vocabulary defaults to 512 ids."""
    import torch
    import transformers
    cfg_cls, model_cls = (getattr(transformers, n) for n in FAMILY_CLASSES[family])
    torch.manual_seed(seed)
    if family.startswith("deepseek"):
        kw = deepseek_config_kwargs(family=family, **shape)
    else:
        kw = tiny_config_kwargs(family, **shape)
    if tokenizer is not None:
        kw["vocab_size"] = shape.get("vocab", 512)
    cfg = cfg_cls(**kw)
    model = model_cls(cfg).float().eval()
    with torch.no_grad():  # norms at 1 are too tame: jitter them so each layer matters
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
        if family.startswith("deepseek"):  # HF: gate ~ N(0, init), bias 0: routing barely varies
            for name, b in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.copy_(torch.randn_like(b) * 0.1)
            for name, p in model.named_parameters():
                if name.endswith("mlp.gate.weight"):
                    p.mul_(4.0)
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out)
    if tokenizer is not None:
        from .tiny_tokenizer import write_tokenizer
        write_tokenizer(out, tokenizer, kw["vocab_size"])
    elif chat_template:
        from megainfer.engine.chat_template import TEMPLATE_FILE
        with open(os.path.join(out, TEMPLATE_FILE), "w", encoding="utf-8") as f:
            f.write(CHAT_TEMPLATE)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", required=True, choices=sorted(FAMILY_CLASSES))
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--inter", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--q-lora-rank", type=int, default=None, help="deepseek_v2/v3 only")
    ap.add_argument("--chat-template", action=argparse.BooleanOptionalAction, default=True,
                    help="write a minimal chat_template.jinja (default: on)")
    ap.add_argument("--tokenizer", choices=["qwen3", "deepseek_v3"], default=None,
                    help="write a byte-level BPE tokenizer and chat template in this style")
    a = ap.parse_args(argv)
    shape = dict(hidden=a.hidden, layers=a.layers, heads=a.heads, experts=a.experts,
                 top_k=a.top_k, inter=a.inter, vocab=a.vocab)
    if a.family.startswith("deepseek"):
        shape.update(q_lora_rank=a.q_lora_rank, layers=max(a.layers, 4), experts=max(a.experts, 8))
    else:
        shape.update(kv_heads=a.kv_heads)
    if a.tokenizer is not None and a.vocab == 256:
        shape["vocab"] = 512
    make_tiny(a.family, a.out, a.seed, chat_template=a.chat_template, tokenizer=a.tokenizer,
              **shape)
    print(f"wrote {a.family} checkpoint to {a.out}"
          + (" (with a chat template)" if a.chat_template else ""))


if __name__ == "__main__":
    main()
