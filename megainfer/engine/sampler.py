"""Logits -> next tokens: penalties, min-tokens, greedy, temperature, top-k, top-p, min-p,
per-request seeds, and the log-probabilities asked for.

Order per row (vLLM v1): logprobs from the raw logits; the grammar's bitmask; min_tokens and
bad_words masks; logit_bias; repetition, frequency and presence penalties; greedy rows take the
argmax, random rows divide by the temperature, filter, and race (argmax of probs / E).

Invariants: everything runs on the logits' device, one host->device copy of the step's tables
and one device->host copy of its tokens. The noise E of row r at vocab position j is
Philox4x32-10 of (key_r, j), key_r from the request's seed and output index, in exact int64
torch ops: CPU and CUDA give the same bits, and a request's samples never depend on its batch,
on preemption, or on earlier steps. docs/engine.md, "Sampling"."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from megainfer.models.attention import to_device_once

from .grammar import Grammars
from .grammar_state import apply_bitmask, grammar_masks
from .philox import MASK32, exponential, mix_seed
from .request import Request

NOISE_CHUNK = 1 << 24  # noise values computed at once (bounds the int64 temporaries)


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  min_p: torch.Tensor) -> torch.Tensor:
    """logits [R, V] (temperature applied), per-row top_k [R] (V: off), top_p [R] (1: off),
    min_p [R] (0: off) -> logits with the dropped tokens at -inf. min-p on the full
    distribution, then top-k, then top-p over what is left; the most likely token always
    survives. A row with every filter off comes back bit-identical. No host sync."""
    R, V = logits.shape
    srt, idx = logits.sort(dim=-1, descending=True)  # [R, V]
    ranks = torch.arange(V, device=logits.device)[None, :]
    probs = srt.softmax(-1)
    drop = probs < min_p[:, None] * probs[:, :1]
    drop |= ranks >= top_k[:, None]
    kept = srt.masked_fill(drop, float("-inf")).softmax(-1)
    # mass before this token already >= top_p; top_p = 1 is off (a cumsum rounding above 1 must
    # not drop the tail, or a row's result would depend on whether another row filters)
    drop |= ((kept.cumsum(-1) - kept) >= top_p[:, None]) & (top_p[:, None] < 1)
    drop[:, 0] = False
    srt = srt.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, idx, srt)


class _HostBuffer:
    """Segments of fp64 host data, sent to the device in one copy (``to_device_once``)."""

    def __init__(self):
        self.parts: list[torch.Tensor] = []
        self.dev: list[torch.Tensor] = []

    def add(self, rows, width: int) -> tuple[int, int]:
        part = rows.to(torch.float64) if isinstance(rows, torch.Tensor) else \
            torch.tensor(rows, dtype=torch.float64)
        self.parts.append(part.reshape(-1))
        return len(self.parts) - 1, width

    def upload(self, device: torch.device) -> None:
        self.dev = to_device_once(self.parts, device)  # the step's one host->device copy

    def get(self, seg) -> torch.Tensor:
        i, width = seg
        return self.dev[i].view(-1, width)


@dataclass
class PromptLogprobJob:
    """Logits rows [row, row + len(targets)) of a prompt chunk: row j predicts targets[j]."""

    row: int
    targets: list[int]
    k: int


@dataclass
class SamplerOutput:
    tokens: list[int]
    # per sampled row: None, or (sampled logprob, its rank, top-k ids, top-k logprobs)
    logprobs: list[Optional[tuple]] = field(default_factory=list)
    # per PromptLogprobJob: list of (target logprob, rank, top-k ids, top-k logprobs)
    prompt: list[list[tuple]] = field(default_factory=list)


class Sampler:
    def __init__(self, grammars: Optional[Grammars] = None):
        self.grammars = grammars  # structured outputs: the tokenizer's compiled grammars

    def __call__(self, logits: torch.Tensor, reqs: Sequence[Request]) -> list[int]:
        """logits [R, V] fp32, one row per request -> R token ids."""
        return self.run(logits, reqs).tokens

    def sample(self, logits: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
        """Like ``__call__`` but the tokens stay on the logits' device (int64 [R]); no sync."""
        return self._sample(logits, reqs, None, [], None)[0]

    def run(self, logits: torch.Tensor, reqs: Sequence[Request],
            rows: Optional[Sequence[int]] = None,
            prompt_jobs: Sequence[PromptLogprobJob] = (), grammar=None) -> SamplerOutput:
        """``reqs[i]`` samples from ``logits[rows[i]]`` (default: row i; a row may repeat: the
        samples of one prompt forking from its last logits). Tokens, the asked logprobs and
        ``prompt_jobs``' logprobs, with one device->host copy. ``grammar``: ``grammar_masks`` of
        ``reqs`` made already (else made here)."""
        tokens, lp_rows, lp, pj = self._sample(logits, reqs, rows, prompt_jobs, grammar)
        packed = [tokens.to(torch.float64)] + [t.to(torch.float64).reshape(-1)
                                                for t in (lp, pj) if t is not None]
        flat = (torch.cat(packed) if len(packed) > 1 else packed[0]).tolist()  # the one copy
        R = len(reqs)
        out = SamplerOutput([int(t) for t in flat[:R]], [None] * R)
        pos = R
        if lp is not None:
            K = (lp.shape[1] - 2) // 2
            for i in lp_rows:
                k = reqs[i].params.logprobs
                rec = flat[pos:pos + 2 + 2 * K]
                pos += 2 + 2 * K
                out.logprobs[i] = (rec[0], int(rec[1]), [int(t) for t in rec[2:2 + k]],
                                   rec[2 + K:2 + K + k])
        if pj is not None:
            K = (pj.shape[1] - 2) // 2
            for job in prompt_jobs:
                recs = []
                for _ in job.targets:
                    rec = flat[pos:pos + 2 + 2 * K]
                    pos += 2 + 2 * K
                    recs.append((rec[0], int(rec[1]), [int(t) for t in rec[2:2 + job.k]],
                                 rec[2 + K:2 + K + job.k]))
                out.prompt.append(recs)
        return out

    # ------------------------------------------------------------------ device side
    def _sample(self, logits: torch.Tensor, reqs: Sequence[Request], rows, prompt_jobs,
                grammar):
        N, V = logits.shape
        R = len(reqs)
        dev = logits.device
        H = _HostBuffer()
        same_rows = rows is None or (len(rows) == N and list(rows) == list(range(N)))
        seg_rows = None if same_rows else H.add(list(rows), 1)
        # random rows: index, temperature, top-k, top-p, min-p, key
        rand, filters = [], False
        # penalised rows: index, repetition, frequency, presence; their (local row, token) pairs
        pen, out_pairs, prompt_pairs, masks, lp_rows, bias = [], [], [], [], [], []
        for i, r in enumerate(reqs):
            p = r.params
            if not p.greedy:
                key = mix_seed(r.seed, len(r.output_token_ids))
                top_k = V if p.top_k == -1 else p.top_k
                filters |= top_k < V or p.top_p < 1 or p.min_p > 0
                rand.append((i, p.temperature, top_k, p.top_p, p.min_p, key & MASK32, key >> 32))
            if p.has_penalties:
                j = len(pen)
                pen.append((i, p.repetition_penalty, p.frequency_penalty, p.presence_penalty))
                out_pairs += [(j, t) for t in r.output_token_ids]
                if p.repetition_penalty != 1:
                    prompt_pairs += [(j, t) for t in r.prompt_set()]
            if p.min_tokens and len(r.output_token_ids) < p.min_tokens:
                stops = set(p.stop_token_ids) | set(r.eos_token_ids)  # eos even with ignore_eos (vLLM)
                masks += [(i, t) for t in sorted(stops) if 0 <= t < V]
            n_out = len(r.output_token_ids)
            for w in r.bad_words_token_ids:  # vLLM: the last token, once the prefix matches
                if len(w) == 1 or r.output_token_ids[n_out + 1 - len(w):] == w[:-1]:
                    masks.append((i, w[-1]))
            if p.logit_bias:
                bias += [(i, t, b) for t, b in p.logit_bias.items() if t < V]
            if p.logprobs is not None:
                lp_rows.append(i)
        if grammar is None:
            grammar = grammar_masks(reqs, self.grammars, V) if self.grammars is not None \
                else ([], None)
        g_rows, g_bits = grammar
        on_host = dev.type == "cpu"  # the bitmask is used where it was filled
        seg_g = H.add(g_rows, 1) if g_rows and not on_host else None
        seg_gbits = H.add(g_bits, g_bits.shape[1]) if seg_g else None  # int32 exact in fp64
        seg_rand = H.add(rand, 7) if rand else None
        seg_pen = H.add(pen, 4) if pen else None
        seg_out = H.add(out_pairs, 2) if out_pairs else None
        seg_prompt = H.add(prompt_pairs, 2) if prompt_pairs else None
        seg_mask = H.add(masks, 2) if masks else None
        seg_bias = H.add(bias, 3) if bias else None
        seg_lp = H.add(lp_rows, 1) if lp_rows and len(lp_rows) < R else None
        pj_rows, pj_tgt = [], []
        for job in prompt_jobs:
            pj_rows += range(job.row, job.row + len(job.targets))
            pj_tgt += job.targets
        seg_pj = H.add(list(zip(pj_rows, pj_tgt)), 2) if pj_rows else None
        if H.parts:
            H.upload(dev)

        x = logits if same_rows else logits.index_select(0, H.get(seg_rows)[:, 0].long())
        lp = None
        if lp_rows:  # raw logprobs, before any processing
            K = max(reqs[i].params.logprobs for i in lp_rows)
            sub = x if seg_lp is None else x.index_select(0, H.get(seg_lp)[:, 0].long())
            lp = (sub, K)
        pj = None
        if seg_pj is not None:
            t = H.get(seg_pj)
            K = max(job.k for job in prompt_jobs)
            pj = _logprob_table(logits.index_select(0, t[:, 0].long()).log_softmax(-1),
                                t[:, 1].long(), K)

        if seg_mask is not None or seg_pen is not None or seg_bias is not None or g_rows:
            # masks write in place: never into the caller's logits or the raw-logprob rows
            x = x.clone() if x is logits or (lp is not None and lp[0] is x) else x
            if g_rows and on_host:
                apply_bitmask(x, g_rows, g_bits)
            elif g_rows:
                apply_bitmask(x, H.get(seg_g)[:, 0].long(), H.get(seg_gbits).to(torch.int32))
            if seg_mask is not None:
                m = H.get(seg_mask).long()
                x.index_put_((m[:, 0], m[:, 1]), x.new_full((), float("-inf")))
            if seg_bias is not None:  # (row, token, bias), each pair once
                b = H.get(seg_bias)
                x.index_put_((b[:, 0].long(), b[:, 1].long()), b[:, 2].to(x.dtype),
                             accumulate=True)
            if seg_pen is not None:
                x = _apply_penalties(x, H.get(seg_pen), None if seg_out is None else H.get(seg_out),
                                     None if seg_prompt is None else H.get(seg_prompt))
        every = len(rand) == R > 0
        tokens = None if every else x.argmax(-1)  # greedy = argmax after the processors
        if seg_rand is not None:
            t = H.get(seg_rand)
            idx = None if every else t[:, 0].long()
            sub = x if every else x.index_select(0, idx)
            sub = sub / t[:, 1:2].float()
            if filters:
                sub = filter_logits(sub, t[:, 2].long(), t[:, 3].float(), t[:, 4].float())
            sampled = _race(sub.softmax(-1), t[:, 5].long(), t[:, 6].long())
            tokens = sampled if every else tokens.index_copy_(0, idx, sampled)
        lp_table = None
        if lp is not None:
            sub, K = lp
            sel = tokens if seg_lp is None else tokens.index_select(0, H.get(seg_lp)[:, 0].long())
            lp_table = _logprob_table(sub.log_softmax(-1), sel, K)
        return tokens, lp_rows, lp_table, pj


def _race(probs: torch.Tensor, key_lo: torch.Tensor, key_hi: torch.Tensor) -> torch.Tensor:
    """argmax(probs / E), E ~ Exp(1) from each row's key; chunked to bound the temporaries."""
    n, V = probs.shape
    step = max(1, NOISE_CHUNK // V)
    if step >= n:
        return (probs / exponential(key_lo, key_hi, V)).argmax(-1)
    sampled = torch.empty(n, dtype=torch.int64, device=probs.device)
    for s in range(0, n, step):
        e = exponential(key_lo[s:s + step], key_hi[s:s + step], V)
        sampled[s:s + step] = (probs[s:s + step] / e).argmax(-1)
    return sampled


def _logprob_table(lp: torch.Tensor, tokens: torch.Tensor, k: int) -> torch.Tensor:
    """log-probs [M, V], tokens [M] -> [M, 2 + 2k] fp64: token logprob, its rank (1 = most
    likely: 1 + the number of strictly more likely tokens), top-k ids, top-k logprobs."""
    tok = lp.gather(1, tokens[:, None])  # [M, 1]
    rank = (lp > tok).sum(-1, keepdim=True) + 1
    cols = [tok.double(), rank.double()]
    if k:
        top = lp.topk(k, dim=-1)
        cols += [top.indices.double(), top.values.double()]
    return torch.cat(cols, 1)


def _apply_penalties(x: torch.Tensor, table: torch.Tensor, out_pairs: Optional[torch.Tensor],
                     prompt_pairs: Optional[torch.Tensor]) -> torch.Tensor:
    """x [R, V]; table [P, 4] (row, repetition, frequency, presence) of the penalised rows;
    (local row, token) pairs of their output tokens (with repeats) and prompt tokens."""
    rows = table[:, 0].long()
    sub = x.index_select(0, rows)  # [P, V]
    counts = torch.zeros_like(sub)
    if out_pairs is not None:
        op = out_pairs.long()
        counts.index_put_((op[:, 0], op[:, 1]), torch.ones(op.shape[0], dtype=sub.dtype,
                                                           device=sub.device), accumulate=True)
    rep = table[:, 1:2].to(sub.dtype)
    seen = counts > 0
    if prompt_pairs is not None:
        pp = prompt_pairs.long()
        seen.index_put_((pp[:, 0], pp[:, 1]), seen.new_ones(()))
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    present = (counts > 0).to(sub.dtype)
    sub = sub - table[:, 2:3].to(sub.dtype) * counts - table[:, 3:4].to(sub.dtype) * present
    return x.index_copy(0, rows, sub)
