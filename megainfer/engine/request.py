"""One request as the engine tracks it: its tokens, status, progress and block table."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Optional

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
    prompt + generated tokens and goes on sampling where it stopped."""

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
    finish_time: Optional[float] = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

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

    def append_token(self, token: int, now: float) -> None:
        """Record a sampled token and finish the request if it hits a stop condition."""
        self.output_token_ids.append(token)
        if self.first_token_time is None:
            self.first_token_time = now
        p = self.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            self.finish("stop", now)
        elif len(self.output_token_ids) >= p.max_tokens or self.num_tokens >= self.max_model_len:
            self.finish("length", now)

    def finish(self, reason: str, now: Optional[float] = None) -> None:
        self.status, self.finish_reason = RequestStatus.FINISHED, reason
        self.finish_time = time.perf_counter() if now is None else now
