"""The request bodies, as OpenAI's and vLLM's APIs name their fields (pydantic models), and
each one's ``SamplingParams``. Unknown fields are refused (400 naming the field) rather than
silently ignored; OpenAI fields megainfer does not serve are refused when set."""
from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from megainfer.engine import SamplingParams
from megainfer.engine.sampling_params import MAX_LOGIT_BIAS

from .errors import APIError


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage on every chunk


class _Sampling(_Body):
    """The sampling fields both endpoints share (OpenAI's, then vLLM's extra body fields)."""

    model: Optional[str] = None  # None: the served model
    n: int = 1
    temperature: Optional[float] = None  # None: 1.0 (OpenAI's default)
    top_p: Optional[float] = None
    seed: Optional[int] = None
    stop: Union[str, list[str], None] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None  # recorded nowhere: OpenAI's abuse-tracking id
    logit_bias: Optional[dict[str, float]] = None  # {token id: bias}, clamped to [-100, 100]
    # vLLM's extra body fields
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: Optional[list[int]] = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: Optional[int] = None  # vLLM: per prompt token, its logprob and the top k
    request_id: Optional[str] = None  # vLLM: the id the engine (and the response) uses

    def sampling_params(self, max_tokens: int, logprobs: Optional[int],
                        prompt_logprobs: Optional[int] = None) -> SamplingParams:
        """This body's ``SamplingParams`` (a bad value: ``SamplingParamsError`` naming it)."""
        if self.stream_options is not None and not self.stream:
            raise APIError("stream_options: only allowed with stream=true",
                           param="stream_options")
        if self.prompt_logprobs is not None and self.stream:
            raise APIError("prompt_logprobs: only without stream", param="prompt_logprobs")
        kw = dict(n=self.n, max_tokens=max_tokens, min_tokens=self.min_tokens,
                  presence_penalty=self.presence_penalty,
                  frequency_penalty=self.frequency_penalty, seed=self.seed,
                  ignore_eos=self.ignore_eos, stop=self.stop or (),
                  stop_token_ids=tuple(self.stop_token_ids or ()),
                  include_stop_str_in_output=self.include_stop_str_in_output,
                  logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                  logit_bias=self._logit_bias(), skip_special_tokens=self.skip_special_tokens)
        for k, v in (("temperature", self.temperature), ("top_p", self.top_p),
                     ("top_k", self.top_k), ("min_p", self.min_p),
                     ("repetition_penalty", self.repetition_penalty)):
            if v is not None:
                kw[k] = v
        if kw.get("top_k") == 0:  # vLLM and OpenAI clients send 0 for "off"
            kw["top_k"] = -1
        return SamplingParams(**kw)

    def _logit_bias(self) -> Optional[dict[int, float]]:
        """OpenAI's {"token id": bias} as {int: bias}, each bias clamped to [-100, 100] (as
        vLLM does); a key that is no token id: 400 naming logit_bias."""
        if not self.logit_bias:
            return None
        out = {}
        for key, bias in self.logit_bias.items():
            try:
                token = int(key)
            except ValueError:
                raise APIError(f"logit_bias: key {key!r} is not a token id", param="logit_bias")
            out[token] = min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, float(bias)))
        return out


Prompt = Union[str, list[str], list[int], list[list[int]]]


class CompletionRequest(_Sampling):
    prompt: Prompt
    max_tokens: Optional[int] = 16  # OpenAI's default; None: up to max_model_len
    logprobs: Optional[int] = None  # the top-k alternatives per token (0: the sampled one)
    echo: bool = False  # the prompt precedes the completion in the text (and logprobs)
    best_of: Optional[int] = None  # only best_of == n is served
    suffix: Optional[str] = None  # refused when set (no insertion)

    def prompts(self) -> list[Union[str, list[int]]]:
        """Each prompt of the body: text or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError("prompt=[]: empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ...: passed to the template
    role: str
    content: Union[str, list[TextPart], None] = None

    def plain(self) -> dict:
        d = self.model_dump(exclude_none=False)
        if isinstance(self.content, list):
            d["content"] = "".join(p.text for p in self.content)
        elif self.content is None:
            d["content"] = ""
        return d


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = None  # deprecated by OpenAI for max_completion_tokens
    max_completion_tokens: Optional[int] = None  # None (both): up to max_model_len
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    add_generation_prompt: bool = True  # vLLM: end the prompt with the assistant's turn opening
    tools: Optional[list] = None  # refused when set (no tool calling yet)
    response_format: Optional[dict] = None  # refused unless {"type": "text"}

    def token_budget(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens


class TokenizeRequest(_Body):
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_generation_prompt: bool = True


class DetokenizeRequest(_Body):
    model: Optional[str] = None
    tokens: list[int]
