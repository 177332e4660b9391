"""What the serving classes share: the served model's name check, the bound on samples, the
drain's 503, streamed responses that give their admission back, and a non-streamed request's
wait that a hang-up cancels."""
from __future__ import annotations

import asyncio
from typing import Optional

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from megainfer.config import ServeConfig

from .served_engine import ServedEngine
from .errors import APIError
from .responses import merged


class ClientGone(Exception):
    """The client hung up before its non-streamed response was ready (nothing to answer)."""


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, coro):
    """Run ``coro``; a client that hangs up first cancels it (its requests are aborted) and
    this raises ``ClientGone`` once the cancelled work has ended."""
    work = asyncio.ensure_future(coro)
    watch = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
        await asyncio.gather(work, watch, return_exceptions=True)
    if work.cancelled():
        raise ClientGone()
    return work.result()


async def finals(streams) -> dict:
    """Each stream's last (finished) output, by index."""
    out = {}
    async for i, o in merged(streams):
        if o.finished:
            out[i] = o
    return out


class Serving:
    def __init__(self, client: ServedEngine, cfg: ServeConfig):
        self.client, self.cfg, self.name = client, cfg, client.model_name

    def check_model(self, model: Optional[str]) -> None:
        if model is not None and model != self.name:
            raise APIError(f"model={model!r}: not served here (this server serves "
                           f"{self.name!r})", 404, "model", "model_not_found")

    def check_samples(self, n: int, best_of: Optional[int] = None) -> None:
        """``n`` (and ``best_of``) within ``serve.max_n`` (400 naming the field)."""
        for field, v in (("n", n), ("best_of", best_of)):
            if v is not None and not 1 <= v <= self.cfg.max_n:
                raise APIError(f"{field}={v}: must be in [1, serve.max_n={self.cfg.max_n}]",
                               400, field)

    def cut_short(self, request_ids) -> None:
        """A 503 when the drain aborted one of the requests (the server shut down first)."""
        if any(r in self.client.cut for r in request_ids):
            raise APIError("the server shut down before the request finished "
                           "(serve.shutdown_grace_s ran out)", 503, code="shutting_down")

    @staticmethod
    def stream_response(events, admission) -> StreamingResponse:
        async def body():
            try:
                async for chunk in events:
                    yield chunk
            finally:
                admission.release()
        return StreamingResponse(body(), media_type="text/event-stream",  # released also if
                                 background=BackgroundTask(admission.release))  # never begun
