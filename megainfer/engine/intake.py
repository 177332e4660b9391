"""A request's prompt as the engine takes it: text or token ids validated into token ids, and
``bad_words`` encoded as vLLM does (``TokenizedPrompt``). Every refusal is a ``RequestError``
naming the culprit."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .errors import EmptyPromptError, PromptTooLongError, RequestError, TokenIdError
from .grammar import Grammars
from .sampling_params import SamplingParams
from .tokenizer import max_prompt_chars


@dataclass(frozen=True)
class TokenizedPrompt:
    """A request's prompt as the engine queues it: text (or None), validated token ids and its
    ``bad_words`` encoded."""

    prompt: Optional[str]
    prompt_token_ids: list[int]
    bad_words_token_ids: list[list[int]]


def tokenize_request(tokenizer, prompt, prompt_token_ids, params, V: int,
                     max_model_len: int, grammars: Optional[Grammars] = None) -> TokenizedPrompt:
    """``tokenize_prompt`` and ``bad_words_token_ids`` for one request, ``params`` checked;
    its structured-outputs grammar compiled (cached: the engine finds it there in this process)
    with ``grammars`` (default: the tokenizer's, the model's eos unknown)."""
    if not isinstance(params, SamplingParams):
        raise RequestError(f"params={params!r}: must be a SamplingParams")
    text, ids = tokenize_prompt(tokenizer, prompt, prompt_token_ids, V, max_model_len)
    bad = bad_words_token_ids(tokenizer, params.bad_words, V) if params.bad_words else []
    far = [t for t in params.logit_bias or () if t >= V]
    if far:
        raise RequestError(f"logit_bias={params.logit_bias!r}: token id {far[0]} is not in "
                           f"[0, vocab_size={V})")
    if params.structured_outputs is not None:
        (grammars or Grammars(tokenizer, V)).get(params.structured_outputs)
    return TokenizedPrompt(text, ids, bad)


def tokenize_prompt(tokenizer, prompt, prompt_token_ids, V: int,
                    max_model_len: int) -> tuple[Optional[str], list[int]]:
    """Text or token ids -> (text or None, validated token ids); a ``RequestError`` names the
    culprit (both given, empty, an id out of range, longer than max_model_len)."""
    if prompt_token_ids is None and not isinstance(prompt, str):
        prompt, prompt_token_ids = None, prompt
    if prompt is not None and prompt_token_ids is not None:
        raise RequestError("prompt and prompt_token_ids: give exactly one")
    if isinstance(prompt, str):
        if not prompt:
            raise EmptyPromptError("prompt='': empty prompt")
        check_text(prompt, "prompt")
        bound = max_prompt_chars(tokenizer, max_model_len)
        if bound is not None and len(prompt) > bound:  # too long for sure: not tokenised
            raise PromptTooLongError(f"prompt length={len(prompt)} characters: exceeds "
                                     f"max_model_len={max_model_len} tokens")
        try:
            ids = tokenizer.encode(prompt)
        except Exception as e:  # noqa: BLE001 - the tokenizer's own failure: this prompt's
            raise RequestError(f"prompt: the tokenizer failed on it ({type(e).__name__}: "
                               f"{e})") from e
    else:
        if prompt_token_ids is None or isinstance(prompt_token_ids, (str, bytes)):
            raise RequestError(f"prompt={prompt_token_ids!r}: must be text or a list of token ids")
        ids = list(prompt_token_ids)
        if not ids:
            raise EmptyPromptError("prompt_token_ids=[]: empty prompt")
    for i, t in enumerate(ids):
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < V:
            raise TokenIdError(f"prompt_token_ids[{i}]={t!r}: must be an integer in "
                               f"[0, vocab_size={V})")
    if len(ids) > max_model_len:
        raise PromptTooLongError(f"prompt length={len(ids)} tokens: exceeds "
                                 f"max_model_len={max_model_len}")
    return prompt, ids


def unencodable(text: str) -> Optional[str]:
    """Why UTF-8 cannot encode ``text`` (a lone surrogate, e.g. from a JSON escape: the
    tokenizer would fail on it), or None when it can."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"not valid Unicode text ({e.reason} at character {e.start})"
    return None


def check_text(text: str, field: str) -> None:
    """A ``RequestError`` naming ``field`` when UTF-8 cannot encode ``text``."""
    why = unencodable(text)
    if why is not None:
        raise RequestError(f"{field}: {why}")


def bad_words_token_ids(tokenizer, words, V: int) -> list[list[int]]:
    """vLLM's encoding of ``bad_words``: each word as is and with a leading space (when that
    gives a different first token and as many tokens), without special tokens."""
    tok = getattr(tokenizer, "tok", None)  # HFTokenizer: encode without BOS/EOS
    enc = (lambda t: tok.encode(t, add_special_tokens=False).ids) if tok is not None else \
        tokenizer.encode
    out = []
    for w in words:
        plain = enc(w.lstrip())
        if plain:
            out.append(plain)
        spaced = enc(" " + w.lstrip())
        if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return [ids for ids in out if all(0 <= t < V for t in ids)]
