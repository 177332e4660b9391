"""Engine outputs -> OpenAI's response and chunk objects (plain dicts, the field names of
OpenAI's completions and chat completions; vLLM's ``stop_reason`` beside ``finish_reason``):
whole responses, and the server-sent events of a stream in OpenAI's chunk format (each choice's
new text and logprobs as they come, its ``finish_reason`` on its last chunk, an optional usage
chunk, then ``data: [DONE]``; several prompts of one completions request run concurrently:
``merged``). The framing is FastAPI's (``fastapi.sse.format_sse_event``)."""
from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import AsyncIterator, Optional

from fastapi.sse import format_sse_event

from megainfer.engine import RequestError, RequestOutput
from megainfer.engine.failures import EngineDeadError

from .chat_message import finish_reason
from .errors import stream_error

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


# ---------------------------------------------------------------- streamed (SSE)
log = logging.getLogger("megainfer.serve")
_END = object()


def _error_event(e: Exception) -> dict:
    """The stream's last event before [DONE]; a bug is logged once."""
    if not isinstance(e, (RequestError, EngineDeadError)):
        log.error("[serve] a stream failed: %s: %s", type(e).__name__, e, exc_info=e)
    return stream_error(e)


def sse(obj) -> bytes:
    return format_sse_event(data_str=obj if isinstance(obj, str) else
                            json.dumps(obj, ensure_ascii=False))


async def merged(streams: list[AsyncIterator]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(stream index, output) from several streams as they come; leaving early (or a stream's
    error) ends them all (each aborts its request)."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i, s):
        try:
            async for out in s:
                q.put_nowait((i, out))
            q.put_nowait((i, _END))
        except Exception as e:  # noqa: BLE001 - re-raised by the consumer
            q.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            i, item = await q.get()
            if item is _END:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class ChoiceDeltas:
    """Per choice: how much text and how many tokens were sent, so each chunk holds the new."""

    def __init__(self, n: int):
        self.n = n
        self.text: dict[int, int] = {}
        self.tokens: dict[int, int] = {}
        self.done: set[int] = set()

    def deltas(self, i: int, out: RequestOutput):
        """(choice index, completion output, new text, first new token) of each sample with
        something new."""
        for c in out.outputs:
            idx = i * self.n + c.index
            if idx in self.done:
                continue
            t0, k0 = self.text.get(idx, 0), self.tokens.get(idx, 0)
            end = out.finished  # a sample that ended early: its final text comes with the
            # request's final output (a stop string's cut, the held-back tail)
            if len(c.text) == t0 and len(c.token_ids) == k0 and not end:
                continue
            self.text[idx], self.tokens[idx] = max(t0, len(c.text)), len(c.token_ids)
            if end:
                self.done.add(idx)
            yield idx, c, c.text[t0:], k0


async def completion_events(stream, rid: str, model: str, n: int, echo_texts: Optional[list],
                            logprobs: Optional[int], include_usage: bool,
                            continuous: bool) -> AsyncIterator[bytes]:
    created, d = now(), ChoiceDeltas(n)
    prompt_tokens: dict[int, int] = {}
    gen, echoed = 0, set()
    try:
        async for i, out in stream:
            prompt_tokens[i] = len(out.prompt_token_ids)
            choices = []
            for idx, c, text, k0 in d.deltas(i, out):
                if echo_texts is not None and idx not in echoed:
                    echoed.add(idx)
                    text = echo_texts[i] + text
                lp = None if logprobs is None or c.logprobs is None else \
                    completion_logprobs(c.logprobs[k0:], c.token_ids[k0:], logprobs)
                gen += len(c.token_ids) - k0
                choices.append({"index": idx, "text": text, "logprobs": lp,
                                "finish_reason": c.finish_reason if idx in d.done else None,
                                "stop_reason": c.stop_reason if idx in d.done else None})
            if choices:
                use = usage(sum(prompt_tokens.values()), gen) if continuous else None
                yield sse(envelope(rid, "text_completion", model, created, choices, use))
        if include_usage:
            yield sse(envelope(rid, "text_completion", model, created, [],
                                 usage(sum(prompt_tokens.values()), gen)))
    except Exception as e:  # noqa: BLE001 - refused, the engine died, a bug: an error event
        yield sse(_error_event(e))
    yield sse("[DONE]")


async def chat_events(stream, rid: str, model: str, n: int, top_logprobs: Optional[int],
                      reader, include_usage: bool, continuous: bool) -> AsyncIterator[bytes]:
    """``reader``: a ``chat_message.MessageReader`` (reasoning, tool calls)."""
    created, d = now(), ChoiceDeltas(n)
    messages = [reader.stream() for _ in range(n)]
    prompt_tokens, gen = 0, 0
    for idx in range(n):  # the assistant's role first, as OpenAI sends it
        yield sse(envelope(rid, "chat.completion.chunk", model, created,
                             [{"index": idx, "delta": {"role": "assistant", "content": ""},
                               "logprobs": None, "finish_reason": None}]))
    try:
        async for _, out in stream:
            prompt_tokens = len(out.prompt_token_ids)
            choices = []
            for idx, c, text, k0 in d.deltas(0, out):
                lp = None if top_logprobs is None or c.logprobs is None else \
                    chat_logprobs(c.logprobs[k0:], c.token_ids[k0:], top_logprobs)
                gen += len(c.token_ids) - k0
                m = messages[idx]
                delta = m.feed(text, idx in d.done)
                choices.append({"index": idx, "delta": delta, "logprobs": lp,
                                "finish_reason": finish_reason(c.finish_reason, m.has_calls)
                                if idx in d.done else None,
                                "stop_reason": c.stop_reason if idx in d.done else None})
            if choices:
                use = usage(prompt_tokens, gen) if continuous else None
                yield sse(envelope(rid, "chat.completion.chunk", model, created, choices,
                                     use))
        if include_usage:
            yield sse(envelope(rid, "chat.completion.chunk", model, created, [],
                                 usage(prompt_tokens, gen)))
    except Exception as e:  # noqa: BLE001 - refused, the engine died, a bug: an error event
        yield sse(_error_event(e))
    yield sse("[DONE]")
