"""Per-request sampling parameters (vLLM-shaped), validated on construction."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Union

from .errors import SamplingParamsError
from .structured_outputs import StructuredOutputsParams

MAX_LOGPROBS = 20  # vLLM's default max_logprobs
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on a logit_bias value


def _check(ok: bool, name: str, value, why: str) -> None:
    if not ok:
        raise SamplingParamsError(f"{name}={value!r}: {why}")


@dataclass(frozen=True)
class SamplingParams:
    """vLLM's names and meanings. temperature 0 is greedy. ``seed`` makes a request's samples
    depend on nothing but its own seed and prompt (not on the batch it ran in); sample ``i`` of
    ``n`` uses a seed derived from (seed, i). ``stop_token_ids`` stop even with ``ignore_eos``.

    ``n``: completions per prompt (sharing the prompt's prefill). ``logprobs``: per sampled
    position, the sampled token's log-probability plus the top ``logprobs`` ones, from the raw
    model distribution (before penalties, temperature and filters). ``prompt_logprobs``: the
    same for every prompt token after the first. ``stop``: strings ending the output (cut from
    the text unless ``include_stop_str_in_output``). ``min_tokens``: eos (even with ``ignore_eos``, as
    vLLM) and ``stop_token_ids`` are masked until that many tokens were generated (stop strings are not checked either).
    ``presence_penalty``/``frequency_penalty`` (OpenAI, on output tokens) and
    ``repetition_penalty`` (HF/CTRL, on prompt and output tokens). ``bad_words``: words never
    generated (their last token is masked once the output ends with the tokens before it).
    ``logit_bias``: {token id: bias in [-100, 100]} added to those logits before the penalties
    (OpenAI's and vLLM's; -100 in effect bans the token, +100 forces it).
    ``skip_special_tokens``: special tokens (eos, bos, ...) add no text (vLLM's default).
    ``structured_outputs``: the grammar the output follows (``StructuredOutputsParams``, or a
    dict of its fields): each step only the tokens the grammar allows next can be sampled, and
    the sample ends (finish_reason "stop") when the grammar is complete and a stop token
    comes, or at once when nothing else could follow (docs/engine.md, "Structured outputs")."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int = 16
    min_tokens: int = 0
    seed: Optional[int] = None
    ignore_eos: bool = False
    stop: Union[tuple[str, ...], str, None] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    bad_words: Union[tuple[str, ...], None] = ()
    logit_bias: Optional[Mapping[int, float]] = None  # {token id: bias in [-100, 100]}
    skip_special_tokens: bool = True  # special tokens add no text
    structured_outputs: Optional[StructuredOutputsParams] = None  # the grammar the output follows

    def __post_init__(self):
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        _check(stop is None or (isinstance(stop, (list, tuple))
                                and all(isinstance(s, str) and s for s in stop)),
               "stop", self.stop, "must be a non-empty string or a list of non-empty strings")
        object.__setattr__(self, "stop", tuple(stop or ()))
        bad = self.bad_words
        _check(bad is None or (isinstance(bad, (list, tuple))
                               and all(isinstance(w, str) and w.strip() for w in bad)),
               "bad_words", self.bad_words, "must be a list of non-blank strings")
        object.__setattr__(self, "bad_words", tuple(bad or ()))
        _check(_is_int(self.n) and self.n >= 1, "n", self.n, "must be an integer >= 1")
        _check(_is_num(self.temperature) and self.temperature >= 0, "temperature", self.temperature,
               "must be >= 0 (0 is greedy)")
        _check(_is_num(self.top_p) and 0 < self.top_p <= 1, "top_p", self.top_p,
               "must be in (0, 1]")
        _check(_is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 1), "top_k", self.top_k,
               "must be -1 (disabled) or >= 1")
        _check(_is_num(self.min_p) and 0 <= self.min_p <= 1, "min_p", self.min_p,
               "must be in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            _check(_is_num(v) and -2 <= v <= 2, name, v, "must be in [-2, 2]")
        _check(_is_num(self.repetition_penalty) and 0 < self.repetition_penalty < float("inf"),
               "repetition_penalty", self.repetition_penalty, "must be > 0 (1 is off)")
        _check(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", self.max_tokens,
               "must be an integer >= 1")
        _check(_is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens, "min_tokens",
               self.min_tokens, f"must be an integer in [0, max_tokens={self.max_tokens}]")
        _check(self.seed is None or _is_int(self.seed), "seed", self.seed,
               "must be an integer or None")
        for t in self.stop_token_ids:
            _check(_is_int(t) and t >= 0, "stop_token_ids", self.stop_token_ids,
                   "must be non-negative integers")
        _check(isinstance(self.skip_special_tokens, bool), "skip_special_tokens",
               self.skip_special_tokens, "must be true or false")
        bias = self.logit_bias
        _check(bias is None or (isinstance(bias, Mapping) and all(
            _is_int(t) and t >= 0 and _is_num(b) and abs(b) <= MAX_LOGIT_BIAS
            for t, b in bias.items())), "logit_bias", bias,
            f"must map token ids (integers >= 0) to biases in [-{MAX_LOGIT_BIAS:g}, "
            f"{MAX_LOGIT_BIAS:g}]")
        object.__setattr__(self, "logit_bias", dict(bias) if bias else None)
        object.__setattr__(self, "structured_outputs",
                           StructuredOutputsParams.of(self.structured_outputs))
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            _check(v is None or (_is_int(v) and 0 <= v <= MAX_LOGPROBS), name, v,
                   f"must be None or an integer in [0, {MAX_LOGPROBS}]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v  # not NaN
