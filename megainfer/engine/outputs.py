"""What goes in (``PromptInput``) and what comes out, vLLM-shaped: ``RequestOutput`` (built from a
finished request by ``request_output``; ``logprob_dict`` for one position) and, per engine step,
``StepOutputs`` (every sample's new tokens as a ``SampleDelta``, and the finished outputs)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

from .detokenizer import decode_text
from .sampling_params import SamplingParams


@dataclass
class PromptInput:
    """One request for ``generate_stream``: text or token ids (exactly one of them)."""

    request_id: Any
    prompt: Optional[str] = None
    prompt_token_ids: Optional[list[int]] = None
    params: SamplingParams = field(default_factory=SamplingParams)

    @classmethod
    def of(cls, request_id, prompt, params: Optional[SamplingParams] = None) -> "PromptInput":
        """A prompt as ``LLM.generate`` takes one: text, token ids, or a dict with ``prompt`` or
        ``prompt_token_ids``."""
        params = SamplingParams() if params is None else params
        if isinstance(prompt, dict):
            return cls(request_id, prompt.get("prompt"), prompt.get("prompt_token_ids"), params)
        if isinstance(prompt, str):
            return cls(request_id, prompt, None, params)
        return cls(request_id, None, prompt, params)


@dataclass
class Logprob:
    """vLLM's: a token's log-probability, its rank (1 = most likely) and its text."""

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


# one dict per position: token id -> Logprob (the sampled / actual token first, then the top-k)
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: Optional[str]  # "stop" | "length" | "abort" | "error"
    logprobs: Optional[list[PositionLogprobs]] = None  # when SamplingParams.logprobs is set
    cumulative_logprob: Optional[float] = None  # sum of the sampled tokens' logprobs (idem)
    stop_reason: Union[int, str, None] = None  # the stop string or stop token id that ended it


@dataclass
class RequestMetrics:
    """Seconds on the engine's ``time.perf_counter`` clock."""

    arrival_time: float
    first_token_time: Optional[float]
    finished_time: Optional[float]
    num_preemptions: int = 0
    kv_handoff_s: Optional[float] = None  # prefill end -> decode start (prefill replicas, docs/pd.md)
    time_in_queue: Optional[float] = None  # arrival at its engine -> its first scheduled step

    @property
    def ttft(self) -> Optional[float]:
        """Time to first token, from arrival (queueing included)."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    def tpot(self, num_output_tokens: int) -> Optional[float]:
        """Mean time per output token after the first."""
        if self.first_token_time is None or self.finished_time is None or num_output_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) / (num_output_tokens - 1)

    @property
    def latency(self) -> Optional[float]:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: Any
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: Optional[RequestMetrics] = None
    error: Optional[str] = None  # set when the request was refused (finish_reason "error")
    # SamplingParams.prompt_logprobs: one entry per prompt token, the first None (as vLLM)
    prompt_logprobs: Optional[list[Optional[PositionLogprobs]]] = None
    # prefix caching: prompt tokens served from the cache at admission (vLLM's name)
    num_cached_tokens: Optional[int] = None

    @classmethod
    def failed(cls, request_id, prompt, prompt_token_ids, error: Exception) -> "RequestOutput":
        msg = f"{type(error).__name__}: {error}"
        return cls(request_id, prompt if isinstance(prompt, str) else None,
                   list(prompt_token_ids or []), [CompletionOutput(0, "", [], "error")], True,
                   None, msg)

    @classmethod
    def aborted(cls, request_id, prompt, prompt_token_ids, n: int = 1) -> "RequestOutput":
        """A request aborted before any replica ran it: ``n`` empty samples ended "abort"."""
        return cls(request_id, prompt if isinstance(prompt, str) else None,
                   list(prompt_token_ids or []),
                   [CompletionOutput(i, "", [], "abort") for i in range(n)], True)


@dataclass
class SampleDelta:
    """One sample's new tokens of one engine step (and how it ended, if it did)."""

    request_id: str
    index: int
    token_ids: list[int]
    logprobs: Optional[list[PositionLogprobs]] = None  # one per new token (params.logprobs)
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None


@dataclass
class StepOutputs:
    """One engine step: the new tokens of every sample that got one, in sampling order, and the
    outputs of the requests that finished (all their samples)."""

    new_tokens: list[SampleDelta] = field(default_factory=list)
    finished: list[RequestOutput] = field(default_factory=list)


def logprob_dict(tokenizer, token: int, rec) -> dict:
    """vLLM's shape: {token: Logprob} with the sampled (or actual) token first, then the
    top-k by rank (1 = most likely)."""
    lp, rank, ids, vals = rec
    dec = tokenizer.decode
    out = {token: Logprob(lp, rank, dec([token]))}
    for k, (t, v) in enumerate(zip(ids, vals), 1):
        if t not in out:
            out[t] = Logprob(v, k, dec([t]))
    return out


def request_output(tokenizer, req, decode: bool = True) -> RequestOutput:
    """The request's (group head's) output: one ``CompletionOutput`` per sample. ``decode``
    False leaves the text of samples not cut by a stop string empty (the frontend decodes)."""
    outs = []
    for s in req.samples:
        # a stop string cut the incrementally detokenized text; else decode it all
        text = s.text if isinstance(s.stop_reason, str) else \
            decode_text(tokenizer, s.output_token_ids, req.params.skip_special_tokens) if decode \
            else ""
        outs.append(CompletionOutput(
            s.index, text, list(s.output_token_ids), s.finish_reason, s.logprobs,
            None if s.logprobs is None else s.cumulative_logprob, s.stop_reason))
    ends = [s.finish_time for s in req.samples if s.finish_time is not None]
    return RequestOutput(
        req.request_id, req.prompt, req.prompt_token_ids, outs, True,
        RequestMetrics(req.arrival_time, req.first_token_time, max(ends) if ends else None,
                       sum(s.num_preemptions for s in req.samples),
                       time_in_queue=req.time_in_queue),
        prompt_logprobs=req.prompt_logprobs,
        num_cached_tokens=max(req.num_cached_tokens, 0))
