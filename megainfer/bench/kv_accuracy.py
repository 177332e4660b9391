"""Teacher-forced logits through a (quantised) paged KV cache, and how far they move: what
``perf/bench/bench_kv_quant.py`` measures accuracy with (docs/kv_cache.md, "Accuracy, capacity and job time").

* ``forced_logits``: sequences teacher-forced in chunks through a cache stored in a
  ``cache.kv_cache_dtype`` with ``tensor`` or ``token_head`` scales; ``emulate`` runs ablations
  the engine does not store (``per-token`` FP8 with a float32 scale, ``per-layer`` as a fidelity
  check of the stored format) by quantising keys and values before a full-precision cache.
* ``compare``: top-1 agreement, mean KL(full || quantised), max |logit error|, and why top-1 is
  fragile on random-weight models: the reference's top-1/top-2 margin, the logit error's sigma,
  and top-1 agreement at positions whose margin exceeds 3 sigma (it explains the all-position
  agreement, the goal; it does not replace it)."""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from megainfer.kernels import kv_quant
from megainfer.models import attention as attention_mod
from megainfer.models.attention import AttentionMetadata
from megainfer.models.kv_spec import kv_cache_spec_for

MARGIN_SIGMAS = 3.0


@contextlib.contextmanager
def emulate(mode: Optional[str], fmt: str = "fp8_e4m3"):
    """While active, the torch GQA store fake-quantises K/V (``mode``: per-token or per-layer)
    into the full-precision cache it is given. None: no change."""
    if mode is None:
        yield
        return
    store = attention_mod.store_kv_torch
    fmax = kv_quant.format_max(fmt)

    def rt(x, scale):
        return kv_quant.dequant_fp8(kv_quant.quant_fp8(x, scale, fmt), scale, x.dtype)

    def fake_store(k, v, kv_cache, slot_mapping):
        if mode == "per-token":  # one scale per (token, KV head)
            k = rt(k, k.detach().abs().amax(-1, keepdim=True).float() / fmax)
            v = rt(v, v.detach().abs().amax(-1, keepdim=True).float() / fmax)
        else:  # per-layer, set once from the first write: the stored format's policy
            sc = kv_quant.scales_of(kv_cache)
            kv_quant.update_scales(sc, fmt, k, v)
            k, v = rt(k, sc[0]), rt(v, sc[1])
        return store(k, v, kv_cache, slot_mapping)

    attention_mod.store_kv_torch = fake_store
    try:
        yield
    finally:
        attention_mod.store_kv_torch = store


def forced_logits(model, cfg, seqs: torch.Tensor, fmt: str, chunk: int, BS: int = 16,
                  dtype: torch.dtype = torch.float32, gran: str = "tensor") -> torch.Tensor:
    """seqs [n, N] teacher-forced one sequence at a time, each through a fresh paged cache in
    ``fmt`` (auto: ``dtype``) with ``gran`` scales (cache.kv_scale_granularity) -> logits
    [n * N, V] fp32."""
    out = []
    for ids in seqs:
        N = ids.shape[0]
        nb = -(-N // BS)
        caches = kv_cache_spec_for(cfg, dtype=dtype, kv_format=fmt,
                                   kv_granularity=gran).allocate(nb, BS)
        table = [list(range(nb))]
        with torch.inference_mode():
            for s in range(0, N, chunk):
                n = min(chunk, N - s)
                meta = AttentionMetadata.build([n], [s], table, BS)
                h = model(ids[s:s + n], torch.arange(s, s + n), meta, caches)
                out.append(model.compute_logits(h).float())
    return torch.cat(out)


def margins(ref: torch.Tensor) -> torch.Tensor:
    top2 = ref.topk(2, dim=-1).values
    return top2[:, 0] - top2[:, 1]


def margin_quantiles(ref: torch.Tensor) -> dict:
    m = margins(ref)
    qs = (0.05, 0.1, 0.25, 0.5)
    return {f"p{int(q * 100)}": v for q, v in zip(qs, m.quantile(torch.tensor(qs)).tolist())}


def compare(ref: torch.Tensor, got: torch.Tensor) -> dict:
    lp, lq = torch.log_softmax(ref, -1), torch.log_softmax(got, -1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    err = got - ref
    agree = ref.argmax(-1) == got.argmax(-1)
    sigma = err.pow(2).mean().sqrt().item()
    safe = margins(ref) > MARGIN_SIGMAS * sigma
    return {"top1_agreement": agree.float().mean().item(), "mean_kl": kl.mean().item(),
            "max_logit_err": err.abs().max().item(), "logit_err_rms": sigma,
            "frac_margin_gt_3sigma": safe.float().mean().item(),
            "top1_agreement_margin_gt_3sigma": agree[safe].float().mean().item()
            if safe.any() else float("nan"),
            "top1_agreement_margin_le_3sigma": agree[~safe].float().mean().item()
            if (~safe).any() else float("nan")}
