"""The request bodies, as OpenAI's and vLLM's APIs name their fields (pydantic models), and
each one's ``SamplingParams``. Unknown fields are refused (400 naming the field) rather than
silently ignored; OpenAI fields megainfer does not serve are refused when set. Types are
strict (no "1" for an int, no false for a token id), numbers finite, every text valid Unicode
that UTF-8 can encode (no lone surrogate), and the free-form fields bounded in length
(docs/serve.md, "Limits")."""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from megainfer.engine import SamplingParams
from megainfer.engine.intake import unencodable
from megainfer.engine.sampling_params import MAX_LOGIT_BIAS

from .errors import APIError
from .response_format import ResponseFormat, structured_spec
from .tools import Tool, ToolChoice


MAX_ID_CHARS = 256  # request_id, user, model
MAX_STOP = 32  # stop strings, each at most MAX_STOP_CHARS
MAX_STOP_CHARS = 512
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS_TOKENS = 1024


def utf8_text(value: str) -> str:
    """``value`` unchanged if UTF-8 can encode it (the engine's rule, ``intake.unencodable``)."""
    why = unencodable(value)
    if why is not None:
        raise ValueError(why)
    return value


def _texts_of(value: Any) -> None:
    """Every string inside ``value`` (nested lists and dicts, keys too) is ``utf8_text``."""
    if isinstance(value, str):
        utf8_text(value)
    elif isinstance(value, dict):
        for k, v in value.items():
            _texts_of(k)
            _texts_of(v)
    elif isinstance(value, list):
        for v in value:
            _texts_of(v)


Text = Annotated[str, AfterValidator(utf8_text)]
ShortText = Annotated[str, Field(max_length=MAX_ID_CHARS), AfterValidator(utf8_text)]
StopText = Annotated[str, Field(max_length=MAX_STOP_CHARS), AfterValidator(utf8_text)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage on every chunk


class _Sampling(_Body):
    """The sampling fields both endpoints share (OpenAI's, then vLLM's extra body fields)."""

    model: Optional[ShortText] = None  # None: the served model
    n: int = 1  # at most serve.max_n
    temperature: Optional[float] = None  # None: 1.0 (OpenAI's default)
    top_p: Optional[float] = None
    seed: Optional[int] = None
    stop: Union[StopText, Annotated[list[StopText], Field(max_length=MAX_STOP)], None] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[ShortText] = None  # recorded nowhere: OpenAI's abuse-tracking id
    # {token id: bias}, clamped to [-100, 100]
    logit_bias: Optional[Annotated[dict[Text, float],
                                   Field(max_length=MAX_LOGIT_BIAS_TOKENS)]] = None
    # vLLM's extra body fields
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: Optional[Annotated[list[int], Field(max_length=MAX_STOP_TOKEN_IDS)]] = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: Optional[int] = None  # vLLM: per prompt token, its logprob and the top k
    request_id: Optional[ShortText] = None  # vLLM: the id the engine (and the response) uses
    # the output's grammar: OpenAI's response_format, or vLLM's structured_outputs (json,
    # regex, choice, grammar, json_object; at most one of the two fields)
    response_format: Optional[ResponseFormat] = Field(default=None, discriminator="type")
    structured_outputs: Optional[dict[Text, Any]] = None

    def grammar_field(self) -> str:
        """The body field a grammar's refusal names."""
        return "structured_outputs" if self.structured_outputs is not None else \
            "response_format"

    def sampling_params(self, max_tokens: int, logprobs: Optional[int],
                        prompt_logprobs: Optional[int] = None,
                        min_tokens: Optional[int] = None, grammar=None) -> SamplingParams:
        """This body's ``SamplingParams`` (a bad value: ``SamplingParamsError`` naming it);
        ``min_tokens``: instead of the body's; ``grammar``: instead of the body's own (a
        forced tool call's)."""
        if self.stream_options is not None and not self.stream:
            raise APIError("stream_options: only allowed with stream=true",
                           param="stream_options")
        if self.prompt_logprobs is not None and self.stream:
            raise APIError("prompt_logprobs: only without stream", param="prompt_logprobs")
        kw = dict(n=self.n, max_tokens=max_tokens,
                  min_tokens=self.min_tokens if min_tokens is None else min_tokens,
                  presence_penalty=self.presence_penalty,
                  frequency_penalty=self.frequency_penalty, seed=self.seed,
                  ignore_eos=self.ignore_eos, stop=self.stop or (),
                  stop_token_ids=tuple(self.stop_token_ids or ()),
                  include_stop_str_in_output=self.include_stop_str_in_output,
                  logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                  logit_bias=self._logit_bias(), skip_special_tokens=self.skip_special_tokens,
                  structured_outputs=grammar or structured_spec(self.response_format,
                                                                self.structured_outputs))
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


Prompt = Union[Text, list[Text], list[int], list[list[int]]]


class CompletionRequest(_Sampling):
    prompt: Prompt
    max_tokens: Optional[int] = 16  # OpenAI's default; None: up to max_model_len
    logprobs: Optional[int] = None  # the top-k alternatives per token (0: the sampled one)
    echo: bool = False  # the prompt precedes the completion in the text (and logprobs)
    best_of: Optional[int] = None  # only best_of == n is served
    suffix: Optional[Text] = None  # refused when set (no insertion)

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
    text: Text


class ChatMessage(BaseModel):
    # name, tool_call_id, ...: passed to the template
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    role: ShortText
    content: Union[Text, list[TextPart], None] = None

    @model_validator(mode="after")
    def _extra_texts(self) -> "ChatMessage":
        _texts_of(self.model_extra or {})
        return self

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
    # OpenAI's function tools; tool_choice none | auto | required | {"type": "function",
    # "function": {"name"}} (docs/serve.md, "Tool calls"); parallel_tool_calls accepted
    tools: Optional[Annotated[list[Tool], Field(max_length=128)]] = None
    tool_choice: Optional[ToolChoice] = None
    parallel_tool_calls: bool = True
    # vLLM's: extra variables of the chat template (e.g. {"enable_thinking": false})
    chat_template_kwargs: Optional[dict[Text, Any]] = None

    def token_budget(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens


class TokenizeRequest(_Body):
    model: Optional[ShortText] = None
    prompt: Optional[Text] = None
    messages: Optional[list[ChatMessage]] = None
    add_generation_prompt: bool = True


class DetokenizeRequest(_Body):
    model: Optional[ShortText] = None
    tokens: list[int]
