"""A tiny MoE checkpoint *trained* on a synthetic language, for accuracy benches that random
weights cannot answer (perf/bench/bench_kv_quant.py).

Random-weight models predict almost uniformly: their top-1/top-2 logit margins are a few
hundredths, so any perturbation of the KV cache (even rounding it to bf16) flips top-1 on
~0.6% of positions. A trained model is confident where its data is predictable and unsure where
it is not, as a real LM is. No weights can be downloaded here, so this trains one in about a
minute on the CPU:

* the language (fixed by ``LANGUAGE_SEED``): a first-order Markov chain over ``vocab`` tokens
  in which each token has 4 successors with probabilities 0.55 / 0.25 / 0.12 / 0.08;
* a sequence of ``length`` tokens: a Markov segment of ``length / 2`` tokens, then the same
  segment again with each token resampled from the chain with probability 0.1. The second
  half rewards attending ``length / 2`` positions back (copying), so the KV cache's precision
  matters over long distances, not only for the last token;
* the model: transformers' ``MixtralForCausalLM`` (or another family) at make_tiny's shape,
  trained with AdamW on fresh sequences, saved with ``save_pretrained`` (safetensors).

``corpus(n, length, seed)`` draws held-out sequences of the same language for evaluation.
"""
from __future__ import annotations

import functools
import os
import time

import torch

LANGUAGE_SEED = 1234
SUCCESSOR_PROBS = (0.55, 0.25, 0.12, 0.08)
COPY_NOISE = 0.1


@functools.lru_cache(maxsize=None)
def _chain(vocab: int) -> torch.Tensor:
    """[vocab, 4] successors of each token (distinct, never the special ids 0..2); made once per
    vocabulary (callers only index it)."""
    g = torch.Generator().manual_seed(LANGUAGE_SEED)
    return torch.stack([3 + torch.randperm(vocab - 3, generator=g)[:4] for _ in range(vocab)])


def _walk(succ: torch.Tensor, n: int, steps: int, g: torch.Generator) -> torch.Tensor:
    """n Markov walks of ``steps`` tokens: [n, steps]."""
    probs = torch.tensor(SUCCESSOR_PROBS)
    out = torch.empty(n, steps, dtype=torch.long)
    out[:, 0] = 3 + torch.randint(succ.shape[0] - 3, (n,), generator=g)
    for t in range(1, steps):
        pick = torch.multinomial(probs.expand(n, -1), 1, generator=g).squeeze(1)
        out[:, t] = succ[out[:, t - 1], pick]
    return out


def corpus(n: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    """[n, length] sequences: a Markov segment, then its noisy copy."""
    g = torch.Generator().manual_seed(seed)
    succ = _chain(vocab)
    half = length // 2
    first = _walk(succ, n, half, g)
    second = first.clone()
    noisy = torch.rand(n, half, generator=g) < COPY_NOISE
    second[noisy] = _walk(succ, n, half, g)[noisy]
    return torch.cat([first, second], 1)[:, :length]


def train_tiny(family: str, out: str, *, steps: int = 600, length: int = 256, batch: int = 16,
               vocab: int = 256, lr: float = 3e-3, seed: int = 0, **shape) -> dict:
    """Train make_tiny's ``family`` shape (``shape``: its overrides, e.g. hidden=256, heads=2,
    kv_heads=1 for head_dim 128) on the language; save to ``out``. Returns the loss curve's
    ends and the seconds it took."""
    import transformers

    from megainfer.tools.make_tiny import FAMILY_CLASSES, tiny_config_kwargs
    cfg_cls, model_cls = (getattr(transformers, n) for n in FAMILY_CLASSES[family])
    torch.manual_seed(seed)
    cfg = cfg_cls(**tiny_config_kwargs(family, vocab=vocab, max_pos=max(512, length), **shape))
    model = model_cls(cfg).float().train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    t0, losses = time.time(), []
    for step in range(steps):
        x = corpus(batch, length, vocab, seed=10_000 + step)
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
    model.eval()
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out)
    return {"family": family, "shape": shape, "steps": steps, "length": length, "batch": batch,
            "loss_first": losses[0], "loss_last10": sum(losses[-10:]) / 10,
            "seconds": time.time() - t0}
