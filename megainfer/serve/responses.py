"""Engine outputs -> OpenAI's response and chunk objects (plain dicts, the field names of
OpenAI's completions and chat completions; vLLM's ``stop_reason`` beside ``finish_reason``)."""
from __future__ import annotations

import time
from typing import Optional

from megainfer.engine import RequestOutput


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def envelope(rid: str, obj: str, model: str, created: int, choices: list,
             use: Optional[dict] = None) -> dict:
    d = {"id": rid, "object": obj, "created": created, "model": model, "choices": choices}
    if use is not None:
        d["usage"] = use
    return d


def now() -> int:
    return int(time.time())


# ---------------------------------------------------------------- logprobs
def _text(entry) -> str:
    return entry.decoded_token if entry.decoded_token is not None else ""


def _top(pos: dict, k: int) -> list:
    """The entries ranked 1..k of one position, by rank."""
    ranked = [(e.rank, t, e) for t, e in pos.items() if e.rank is not None and e.rank <= k]
    return [(t, e) for _, t, e in sorted(ranked, key=lambda x: x[0])]


def chat_logprobs(positions: list, token_ids: list[int], k: int) -> dict:
    """OpenAI chat's ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    content = []
    for tok, pos in zip(token_ids, positions):
        e = pos[tok]
        content.append({"token": _text(e), "logprob": e.logprob,
                        "bytes": list(_text(e).encode("utf-8")),
                        "top_logprobs": [{"token": _text(x), "logprob": x.logprob,
                                          "bytes": list(_text(x).encode("utf-8"))}
                                         for _, x in _top(pos, k)]})
    return {"content": content}


def completion_logprobs(positions: list, token_ids: list[int], k: int,
                        offset: int = 0, decode=None) -> dict:
    """OpenAI completions' ``{tokens, token_logprobs, top_logprobs, text_offset}``; a position
    without logprobs (the prompt's first token under echo) has its token's text (``decode``:
    token ids -> text) and null logprobs, as vLLM gives it."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tok, pos in zip(token_ids, positions):
        if pos is None:
            out["tokens"].append("" if decode is None else decode([tok]))
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
        else:
            e = pos[tok]
            out["tokens"].append(_text(e))
            out["token_logprobs"].append(e.logprob)
            top: dict = {}
            for _, x in _top(pos, k):  # tokens with the same text: the better ranked one
                top.setdefault(_text(x), x.logprob)
            out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(out["tokens"][-1])
    return out


def prompt_logprobs(positions: Optional[list], token_ids: list[int], k: int) -> Optional[list]:
    """vLLM's ``prompt_logprobs``: per prompt token, null for the first, else
    ``{"token id": {logprob, rank, decoded_token}}`` of the prompt's token and the top ``k``."""
    if positions is None:
        return None
    out = []
    for tok, pos in zip(token_ids, positions):
        if pos is None:
            out.append(None)
            continue
        keep = {tok: pos[tok], **dict(_top(pos, k))}
        out.append({str(t): {"logprob": e.logprob, "rank": e.rank,
                             "decoded_token": e.decoded_token} for t, e in keep.items()})
    return out


def merge_logprobs(a: Optional[dict], b: dict) -> dict:
    if a is None:
        return b
    return {k: a[k] + b[k] for k in a}


# ---------------------------------------------------------------- whole responses
def completion_choice(index: int, out, text: str, logprobs: Optional[dict],
                      prompt_lp: Optional[list] = None) -> dict:
    choice = {"index": index, "text": text, "logprobs": logprobs,
              "finish_reason": out.finish_reason, "stop_reason": out.stop_reason}
    if prompt_lp is not None:  # vLLM's field, only when asked
        choice["prompt_logprobs"] = prompt_lp
    return choice


def chat_choice(index: int, out, logprobs: Optional[dict], message: Optional[dict] = None,
                finish_reason: Optional[str] = None) -> dict:
    """``message``: the assistant's (default: the text as content); ``finish_reason``:
    instead of the output's (tool calls)."""
    return {"index": index, "message": message or {"role": "assistant", "content": out.text},
            "logprobs": logprobs, "finish_reason": finish_reason or out.finish_reason,
            "stop_reason": out.stop_reason}


def tokens_of(outs: list[RequestOutput]) -> tuple[int, int]:
    """(prompt tokens, completion tokens) over requests and their samples."""
    return (sum(len(o.prompt_token_ids) for o in outs),
            sum(len(c.token_ids) for o in outs for c in o.outputs))
