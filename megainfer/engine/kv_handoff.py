"""A request crossing from one engine to another, without the engine's code knowing about it.

* Prefill -> decode (PD): once a prompt's first token is sampled, ``export_state`` captures
  what decoding needs (tokens, seed, logprobs, detokenizer offsets, timings) and ``detach``
  takes the request out (its blocks back, kept as prefix-cache entries). The decode side
  ``reserve``s blocks for the prompt's KV before it arrives (a placeholder holds them),
  ``start`` makes the placeholder the real request with ``num_computed_tokens`` = prompt length
  and its first token, ``release`` gives the blocks back unused. Invariant: the sampler's key
  is (seed, output index), so the tokens that follow are single mode's.
* A running request moved whole (a re-plan): ``export_kv`` / ``import_kv`` of one host byte
  buffer (``kv_bytes`` long), ``adopt`` gives the blocks to the request.
docs/pd.md, "What runs where"; docs/replan.md, "Switch"."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from .request import Request
from .sampling_params import SamplingParams


@dataclass
class HandoffState:
    """A request (its group head, sample 0) as decoding needs it; ``samples``: the states of
    samples 1..n-1 (``SamplingParams.n > 1``), each with its own seed and first token, some
    maybe finished already (eos at the first token)."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    output_token_ids: list[int]
    arrival_time: float
    first_token_time: Optional[float]
    num_cached_tokens: int = 0
    logprobs: Optional[list] = None
    cumulative_logprob: float = 0.0
    prompt_logprobs: Optional[list] = None
    text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0
    bad_words_token_ids: list = field(default_factory=list)
    num_preemptions: int = 0
    t_prefill_end: float = 0.0  # perf_counter when the prefill step ended (same node clock)
    index: int = 0
    finish_reason: Optional[str] = None  # a sample finished at its first token
    stop_reason: object = None
    finish_time: Optional[float] = None
    samples: list = field(default_factory=list)
    time_in_queue: Optional[float] = None


def export_state(req: Request) -> HandoffState:
    """The group head ``req`` and its samples."""
    state = _state(req)
    state.samples = [_state(s) for s in req.samples[1:]]
    return state


def _state(req: Request) -> HandoffState:
    return HandoffState(
        req.request_id, req.prompt, list(req.prompt_token_ids), req.params, req.seed,
        list(req.output_token_ids), req.arrival_time, req.first_token_time,
        max(req.num_cached_tokens, 0), req.logprobs, req.cumulative_logprob, req.prompt_logprobs,
        req.text, req.prefix_offset, req.read_offset, req.bad_words_token_ids,
        req.num_preemptions, time.perf_counter(), req.index,
        req.finish_reason if req.is_finished else None, req.stop_reason, req.finish_time,
        time_in_queue=req.time_in_queue)


def detach(engine, req: Request) -> None:
    """Take a request (its first tokens sampled) out of the engine, every sample's blocks
    freed (a sample finished at its first token gave its blocks back already)."""
    for s in req.samples or [req]:
        engine.scheduler.finish(s)  # out of its queue (running, or waiting for a seat)
    engine.requests.pop(req.request_id, None)


def reserve(engine, num_tokens: int, tag: str) -> Optional[Request]:
    """A placeholder holding the blocks of ``num_tokens`` tokens, or None when too few are free
    (the caller retries later; the same calls give the same blocks on every TP rank)."""
    ph = Request(-1, tag, None, [], SamplingParams(), seed=0)
    if not engine.blocks.allocate(ph, num_tokens):
        return None
    return ph


def release(engine, placeholder: Request) -> None:
    engine.blocks.free_request(placeholder)


def start(engine, state: HandoffState, placeholder: Request) -> Request:
    """The request, running in ``engine`` with its prompt's KV in ``placeholder``'s blocks. Its
    unfinished samples share those blocks (as single mode's forks do; copy on write), in
    sample order after the head, as single mode queues its forks (those beyond
    ``max_num_seqs`` wait for a seat, as there)."""
    states = [state] + list(state.samples)
    seq_id = engine._next_seq_id
    engine._next_seq_id += len(states)
    reqs = [_request(engine, s, seq_id + i) for i, s in enumerate(states)]
    head = reqs[0]
    head.samples, head.pending = reqs, []
    head.prompt_logprobs = state.prompt_logprobs
    live = [r for r in reqs if not r.is_finished]
    head.num_unfinished = len(live)
    owner = live[0]  # the prefill rank reports a request whose samples all finished as output
    adopt(owner, placeholder)
    engine.blocks.cache_full_blocks(owner)  # its full prompt blocks join this replica's cache
    for r in live[1:]:
        engine.blocks.fork(owner, r)
    engine.requests[head.request_id] = head
    for r in live:
        engine.scheduler.add_running(r)
    return head


def _request(engine, state: HandoffState, seq_id: int) -> Request:
    cfg = engine.model_config
    req = Request(seq_id, state.request_id, state.prompt, state.prompt_token_ids, state.params,
                  seed=state.seed, eos_token_ids=cfg.eos_token_id,
                  max_model_len=engine.max_model_len, logprobs=state.logprobs, index=state.index)
    req.output_token_ids = list(state.output_token_ids)
    req.arrival_time, req.first_token_time = state.arrival_time, state.first_token_time
    req.time_in_queue = state.time_in_queue
    req.cumulative_logprob = state.cumulative_logprob
    req.text, req.prefix_offset, req.read_offset = state.text, state.prefix_offset, state.read_offset
    req.bad_words_token_ids, req.num_preemptions = state.bad_words_token_ids, state.num_preemptions
    req.num_cached_tokens = state.num_cached_tokens
    req.stop_reason = state.stop_reason
    if state.finish_reason is not None:
        req.finish(state.finish_reason, state.finish_time)
        return req
    req.num_computed_tokens = len(state.prompt_token_ids)  # ``start`` queues it
    return req


def adopt(req: Request, placeholder: Request) -> None:
    """``req`` (without blocks) takes the blocks ``reserve`` gave ``placeholder``."""
    req.block_table, placeholder.block_table = placeholder.block_table, []


def kv_bytes(engine, num_blocks: int) -> int:
    """Bytes of ``num_blocks`` blocks of every layer (what ``export_kv`` returns)."""
    d = engine.kv_spec.block_axis
    return num_blocks * sum(kv.select(d, 0).numel() * kv.element_size()
                            for kv in engine.kv_caches)


def export_kv(engine, table: list[int]) -> np.ndarray:
    """The blocks' KV of every layer, as stored, as one host byte buffer (layer-major)."""
    d = engine.kv_spec.block_axis
    idx = torch.tensor(table, dtype=torch.long, device=engine.kv_caches[0].device)
    parts = [kv.index_select(d, idx).contiguous().view(torch.uint8).flatten().cpu()
             for kv in engine.kv_caches]
    return torch.cat(parts).numpy()


def import_kv(engine, table: list[int], buf: np.ndarray) -> None:
    """``export_kv``'s buffer into the blocks ``table`` of every layer."""
    d = engine.kv_spec.block_axis
    idx = torch.tensor(table, dtype=torch.long, device=engine.kv_caches[0].device)
    data, off = torch.from_numpy(buf), 0
    for kv in engine.kv_caches:
        if kv.element_size() == 1:  # float8 / packed fp4: copied as bytes (no fp8 index_copy)
            kv = kv.view(torch.uint8)
        shape = list(kv.shape)
        shape[d] = len(table)
        n = int(np.prod(shape)) * kv.element_size()
        part = data[off:off + n].view(kv.dtype).view(shape).to(kv.device)
        kv.index_copy_(d, idx, part)
        off += n
