"""The decode steps perf/bench/bench_decode_step.py times, and the floor of one: B rows over a
paged cache through ``AttentionMetadata.build_with`` + ``MoECausalLM.forward`` +
``compute_logits`` (what ``LocalExecutor.execute`` runs), the same context for every row
(``OursStep``) or mixed contexts (``MixedStep``), and HF's forward over a ``DynamicCache``."""
from __future__ import annotations

import math
import time

import torch

import bench_offline


def step_floor(a, B: int, ctx: int, n_params: int, bw: float, rate: float) -> dict:
    """``a``: the model shape (SHAPE's fields) -> the step's bytes, FLOPs and floor seconds."""
    D = a.hidden // a.heads
    per_expert = 3 * a.hidden * a.inter
    experts_read = min(a.experts, B * a.top_k)
    weights = n_params - a.vocab * a.hidden - a.layers * (a.experts - experts_read) * per_expert
    kv = 4 * 2 * a.layers * a.kv_heads * D * B * (ctx + 1)
    nbytes = 4 * weights + kv
    flops = B * bench_offline.active_flops_per_token(a, ctx + 1)
    return dict(bytes=nbytes, flops=flops, read_s=nbytes / bw, flops_s=flops / rate,
                seconds=max(nbytes / bw, flops / rate))


class OursStep:
    """B decode rows over a paged cache of ``ctx`` tokens each (block 16)."""

    def __init__(self, model, B: int, ctx: int, block: int = 16):
        from megainfer.models.attention import allocate_kv_cache
        cfg = model.config
        nb = math.ceil((ctx + 1) / block)
        self.model, self.B, self.ctx, self.block = model, B, ctx, block
        self.caches = allocate_kv_cache(cfg.num_layers, B * nb + 1, block, cfg.num_kv_heads,
                                        cfg.head_dim)
        for c in self.caches:
            c.normal_()
        self.tables = [[1 + s * nb + j for j in range(nb)] for s in range(B)]
        g = torch.Generator().manual_seed(B)
        self.ids = torch.randint(3, cfg.vocab_size, (B,), generator=g)

    @torch.inference_mode()
    def __call__(self):
        from megainfer.models.attention import AttentionMetadata
        B = self.B
        meta, (ids, pos) = AttentionMetadata.build_with(
            [1] * B, [self.ctx] * B, self.tables, self.block,
            extras=[self.ids, torch.full((B,), self.ctx, dtype=torch.long)])
        return self.model.compute_logits(self.model(ids, pos, meta, self.caches))


class MixedStep(OursStep):
    """B decode rows whose contexts are drawn from [lo, hi] (seeded), block 16."""

    def __init__(self, model, B: int, lo: int, hi: int, block: int = 16):
        from megainfer.models.attention import allocate_kv_cache
        cfg = model.config
        g = torch.Generator().manual_seed(B)
        self.ctxs = torch.randint(lo, hi + 1, (B,), generator=g).tolist()
        nbs = [math.ceil((c + 1) / block) for c in self.ctxs]
        self.model, self.B, self.block = model, B, block
        self.caches = allocate_kv_cache(cfg.num_layers, sum(nbs) + 1, block, cfg.num_kv_heads,
                                        cfg.head_dim)
        for c in self.caches:
            c.normal_()
        at, self.tables = 1, []
        for n in nbs:
            self.tables.append(list(range(at, at + n)))
            at += n
        self.ids = torch.randint(3, cfg.vocab_size, (B,), generator=g)

    @torch.inference_mode()
    def __call__(self):
        from megainfer.models.attention import AttentionMetadata
        meta, (ids, pos) = AttentionMetadata.build_with(
            [1] * self.B, self.ctxs, self.tables, self.block,
            extras=[self.ids, torch.tensor(self.ctxs, dtype=torch.long)])
        return self.model.compute_logits(self.model(ids, pos, meta, self.caches))


class HFStep:
    def __init__(self, hf, B: int, ctx: int):
        from transformers import DynamicCache
        g = torch.Generator().manual_seed(B)
        prompt = torch.randint(3, hf.config.vocab_size, (B, ctx), generator=g)
        self.cache = DynamicCache()
        with torch.inference_mode():
            hf(prompt, past_key_values=self.cache, use_cache=True)
        self.hf, self.ctx = hf, ctx
        self.ids = torch.randint(3, hf.config.vocab_size, (B, 1), generator=g)

    @torch.inference_mode()
    def __call__(self):
        out = self.hf(self.ids, past_key_values=self.cache, use_cache=True)
        self.cache.crop(-1)  # back to ctx tokens
        return out.logits


def time_once(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


class ScatteredStep(OursStep):
    """``OursStep`` with its block ids shuffled over the rows (seeded): no row is one run of
    blocks, as in an engine whose freed blocks came back in another order; every layer gathers."""

    def __init__(self, model, B: int, ctx: int, block: int = 16):
        super().__init__(model, B, ctx, block)
        flat = [b for row in self.tables for b in row]
        perm = torch.randperm(len(flat), generator=torch.Generator().manual_seed(B)).tolist()
        nb = len(self.tables[0])
        self.tables = [[flat[perm[s * nb + j]] for j in range(nb)] for s in range(B)]
