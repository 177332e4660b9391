"""Write a tiny random checkpoint of one family with transformers' ``save_pretrained``.

    python -m megainfer.tools.make_tiny --family mixtral --out DIR [--experts 6 --top-k 3 ...]

Seeded, and initialised wider than HF's default (``initializer_range``) so that greedy argmax
margins sit well above float noise: tests compare greedy tokens across deploy modes.
"""
from __future__ import annotations

import argparse
import os

FAMILY_CLASSES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
}


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


def make_tiny(family: str, out: str, seed: int = 0, **shape) -> str:
    """Build, seed-initialise and save a tiny HF checkpoint of ``family`` into ``out``."""
    import torch
    import transformers
    cfg_cls, model_cls = (getattr(transformers, n) for n in FAMILY_CLASSES[family])
    torch.manual_seed(seed)
    cfg = cfg_cls(**tiny_config_kwargs(family, **shape))
    model = model_cls(cfg).float().eval()
    with torch.no_grad():  # norms at 1 are too tame: jitter them so each layer matters
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out)
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
    a = ap.parse_args(argv)
    make_tiny(a.family, a.out, a.seed, hidden=a.hidden, layers=a.layers, heads=a.heads,
              kv_heads=a.kv_heads, experts=a.experts, top_k=a.top_k, inter=a.inter, vocab=a.vocab)
    print(f"wrote {a.family} checkpoint to {a.out}")


if __name__ == "__main__":
    main()
