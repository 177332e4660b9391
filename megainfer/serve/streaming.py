"""Server-sent events in OpenAI's chunk format: each choice's new text (and logprobs) as it
comes, its ``finish_reason`` on its last chunk, an optional usage chunk, then ``data: [DONE]``.
Several prompts of one completions request run concurrently (``merged``). The framing is
FastAPI's (``fastapi.sse.format_sse_event``)."""
from __future__ import annotations

import asyncio
import json
import logging
from typing import AsyncIterator, Optional

from fastapi.sse import format_sse_event

from megainfer.engine import RequestError, RequestOutput
from megainfer.engine.failures import EngineDeadError

from . import responses as R
from .chat_message import finish_reason
from .errors import stream_error

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
    created, d = R.now(), ChoiceDeltas(n)
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
                    R.completion_logprobs(c.logprobs[k0:], c.token_ids[k0:], logprobs)
                gen += len(c.token_ids) - k0
                choices.append({"index": idx, "text": text, "logprobs": lp,
                                "finish_reason": c.finish_reason if idx in d.done else None,
                                "stop_reason": c.stop_reason if idx in d.done else None})
            if choices:
                use = R.usage(sum(prompt_tokens.values()), gen) if continuous else None
                yield sse(R.envelope(rid, "text_completion", model, created, choices, use))
        if include_usage:
            yield sse(R.envelope(rid, "text_completion", model, created, [],
                                 R.usage(sum(prompt_tokens.values()), gen)))
    except Exception as e:  # noqa: BLE001 - refused, the engine died, a bug: an error event
        yield sse(_error_event(e))
    yield sse("[DONE]")


async def chat_events(stream, rid: str, model: str, n: int, top_logprobs: Optional[int],
                      reader, include_usage: bool, continuous: bool) -> AsyncIterator[bytes]:
    """``reader``: a ``chat_message.MessageReader`` (reasoning, tool calls)."""
    created, d = R.now(), ChoiceDeltas(n)
    messages = [reader.stream() for _ in range(n)]
    prompt_tokens, gen = 0, 0
    for idx in range(n):  # the assistant's role first, as OpenAI sends it
        yield sse(R.envelope(rid, "chat.completion.chunk", model, created,
                             [{"index": idx, "delta": {"role": "assistant", "content": ""},
                               "logprobs": None, "finish_reason": None}]))
    try:
        async for _, out in stream:
            prompt_tokens = len(out.prompt_token_ids)
            choices = []
            for idx, c, text, k0 in d.deltas(0, out):
                lp = None if top_logprobs is None or c.logprobs is None else \
                    R.chat_logprobs(c.logprobs[k0:], c.token_ids[k0:], top_logprobs)
                gen += len(c.token_ids) - k0
                m = messages[idx]
                delta = m.feed(text, idx in d.done)
                choices.append({"index": idx, "delta": delta, "logprobs": lp,
                                "finish_reason": finish_reason(c.finish_reason, m.has_calls)
                                if idx in d.done else None,
                                "stop_reason": c.stop_reason if idx in d.done else None})
            if choices:
                use = R.usage(prompt_tokens, gen) if continuous else None
                yield sse(R.envelope(rid, "chat.completion.chunk", model, created, choices,
                                     use))
        if include_usage:
            yield sse(R.envelope(rid, "chat.completion.chunk", model, created, [],
                                 R.usage(prompt_tokens, gen)))
    except Exception as e:  # noqa: BLE001 - refused, the engine died, a bug: an error event
        yield sse(_error_event(e))
    yield sse("[DONE]")
