"""One request as the engine tracks it: its tokens, status, progress and block table."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Optional, Union

from .detokenizer import detokenize_step, find_stop_string
from .sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """``all_token_ids`` = prompt + generated. ``num_computed_tokens`` of them have keys/values in
    the cache (the blocks in ``block_table``); the rest are fed to the model in coming steps.
    Preemption frees the blocks and resets ``num_computed_tokens`` to 0: the request recomputes
    prompt + generated tokens and goes on sampling where it stopped.

    ``SamplingParams.n`` > 1: one ``Request`` per sample (``index`` 0..n-1), all with the same
    ``request_id``. Sample 0 (the group's head) is scheduled first; the others wait in its
    ``pending`` list and fork from it once its prompt is computed (they share its blocks and
    its first logits), so the prompt is computed once. ``samples`` (on the head) lists all n;
    forks beyond ``max_num_seqs`` wait for a seat in the scheduler's ``forked`` queue."""

    seq_id: int  # engine-internal, monotonically increasing: the scheduling priority
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # the sampler's seed: params.seed, or one derived from the engine seed and seq_id
    eos_token_ids: tuple[int, ...] = ()
    max_model_len: int = 2048
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    finish_reason: Optional[str] = None
    num_preemptions: int = 0
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: Optional[float] = None
    time_in_queue: Optional[float] = None  # seconds from arrival to its first scheduled step
    finish_time: Optional[float] = None
    index: int = 0  # sample index within the request (SamplingParams.n)
    samples: list["Request"] = field(default_factory=list)  # head only: all n (itself first)
    pending: list["Request"] = field(default_factory=list)  # head only: samples not forked yet
    num_unfinished: int = 1  # head only: samples not finished yet (the request ends at 0)
    logprobs: Optional[list] = None  # list[dict[int, Logprob]] when params.logprobs is set
    cumulative_logprob: float = 0.0
    prompt_logprobs: Optional[list] = None  # head only: [None, dict, ...] as they are computed
    stop_reason: Union[int, str, None] = None
    # stop strings: incremental detokenization (detokenizer.py: vLLM's offsets) and the text
    text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0
    _prompt_set: Optional[list[int]] = field(default=None, repr=False)
    bad_words_token_ids: list[list[int]] = field(default_factory=list)  # params.bad_words, encoded
    grammar: Optional[object] = None  # structured outputs: its GrammarState (grammar_state.py)
    # prefix caching (BlockManager): prompt tokens served from the cache at first admission
    # (-1: not admitted yet), the keys of the full blocks by content (memoized), and the
    # content ids of the full blocks registered or found so far (0: a collision ended the chain)
    num_cached_tokens: int = -1
    block_hashes: list[int] = field(default_factory=list, repr=False)
    block_uids: list[int] = field(default_factory=list, repr=False)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def prompt_set(self) -> list[int]:
        """The prompt's distinct token ids (cached: the repetition penalty's per-step input)."""
        if self._prompt_set is None:
            self._prompt_set = sorted(set(self.prompt_token_ids))
        return self._prompt_set

    def token_slice(self, start: int, stop: int) -> list[int]:
        """Tokens [start, stop) of prompt + output, without building the concatenation."""
        P = len(self.prompt_token_ids)
        if stop <= P:
            return self.prompt_token_ids[start:stop]
        if start >= P:
            return self.output_token_ids[start - P:stop - P]
        return self.prompt_token_ids[start:] + self.output_token_ids[:stop - P]

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def append_token(self, token: int, now: float, tokenizer=None) -> None:
        """Record a sampled token and finish the request if it hits a stop condition (stop
        tokens, eos and stop strings only once ``min_tokens`` were generated, as vLLM)."""
        self.output_token_ids.append(token)
        if self.first_token_time is None:
            self.first_token_time = now
        p = self.params
        new_chars = detokenize_step(self, tokenizer, self.output_token_ids,
                                    p.skip_special_tokens) \
            if p.stop and tokenizer is not None else 0
        if len(self.output_token_ids) >= p.min_tokens:
            if token in p.stop_token_ids:
                self.stop_reason = token
                self.finish("stop", now)
                return
            if not p.ignore_eos and token in self.eos_token_ids:
                self.finish("stop", now)
                return
            if new_chars:
                self.stop_reason = find_stop_string(self, p.stop, p.include_stop_str_in_output,
                                                    new_chars)
                if self.stop_reason is not None:
                    self.finish("stop", now)
                    return
        if len(self.output_token_ids) >= p.max_tokens or self.num_tokens >= self.max_model_len:
            self.finish("length", now)

    def finish(self, reason: str, now: Optional[float] = None) -> None:
        self.status, self.finish_reason = RequestStatus.FINISHED, reason
        self.finish_time = time.perf_counter() if now is None else now
