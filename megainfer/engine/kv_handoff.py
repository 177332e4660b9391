"""A request crossing from a prefill engine to a decode engine (prefill-decode disaggregation,
docs/pd.md), without the engine's code knowing about it.

* Prefill side: once the step that completes a request's prompt has sampled its first token,
  ``export_state`` captures everything decoding needs (tokens, sampler seed, logprobs so far,
  detokenizer offsets, timings) and ``detach`` takes the request out of the engine: its blocks
  go back (kept as prefix-cache entries when caching is on); its KV already left, layer by layer.
* Decode side: ``reserve`` takes the blocks for the prompt's KV before it arrives (a placeholder
  request holds them), ``start`` turns the placeholder into the real request, running, with
  ``num_computed_tokens`` = prompt length and its first token: the next step decodes it as if
  this engine had prefilled it. The sampler's key is (seed, output index), so the tokens that
  follow are the ones single mode samples. ``release`` gives the blocks back unused.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

from .request import Request, RequestStatus
from .sampling_params import SamplingParams


@dataclass
class HandoffState:
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


def export_state(req: Request) -> HandoffState:
    return HandoffState(
        req.request_id, req.prompt, list(req.prompt_token_ids), req.params, req.seed,
        list(req.output_token_ids), req.arrival_time, req.first_token_time,
        max(req.num_cached_tokens, 0), req.logprobs, req.cumulative_logprob, req.prompt_logprobs,
        req.text, req.prefix_offset, req.read_offset, req.bad_words_token_ids,
        req.num_preemptions, time.perf_counter())


def detach(engine, req: Request) -> None:
    """Take a running request (its first token sampled) out of the engine, blocks freed."""
    engine.scheduler.running.remove(req)
    engine.blocks.free_request(req)
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
    """The request, running in ``engine`` with its prompt's KV in ``placeholder``'s blocks."""
    cfg = engine.model_config
    seq_id = engine._next_seq_id
    engine._next_seq_id += 1
    req = Request(seq_id, state.request_id, state.prompt, state.prompt_token_ids, state.params,
                  seed=state.seed, eos_token_ids=cfg.eos_token_id,
                  max_model_len=engine.max_model_len, logprobs=state.logprobs)
    req.output_token_ids = list(state.output_token_ids)
    req.arrival_time, req.first_token_time = state.arrival_time, state.first_token_time
    req.cumulative_logprob, req.prompt_logprobs = state.cumulative_logprob, state.prompt_logprobs
    req.text, req.prefix_offset, req.read_offset = state.text, state.prefix_offset, state.read_offset
    req.bad_words_token_ids, req.num_preemptions = state.bad_words_token_ids, state.num_preemptions
    req.num_cached_tokens = state.num_cached_tokens
    req.block_table, placeholder.block_table = placeholder.block_table, []
    req.num_computed_tokens = len(state.prompt_token_ids)
    req.samples, req.pending = [req], []
    req.status = RequestStatus.RUNNING
    engine.requests[req.request_id] = req
    engine.scheduler.running.append(req)
    engine.blocks.cache_full_blocks(req)  # its full prompt blocks join this replica's cache
    return req
