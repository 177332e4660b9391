"""The FastAPI application: OpenAI's /v1/completions, /v1/chat/completions and /v1/models,
vLLM's /tokenize, /detokenize, /health, /metrics and /version (docs/serve.md)."""
from __future__ import annotations

import asyncio
import secrets
import uuid
from contextlib import asynccontextmanager
from typing import Optional

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.background import BackgroundTask

from megainfer.config import ServeConfig

from . import errors, responses as R
from .chat import ChatPrompts
from .engine_client import EngineClient
from .errors import APIError
from .protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                       TokenizeRequest)
from .streaming import chat_events, completion_events, merged


def version() -> str:
    from importlib.metadata import PackageNotFoundError, version as v
    try:
        return v("megainfer")
    except PackageNotFoundError:  # pragma: no cover - a source tree without an install
        return "unknown"


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, coro):
    """Run ``coro``; a client that hangs up first cancels it (its requests are aborted)."""
    work = asyncio.ensure_future(coro)
    watch = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
    if work.cancelled():
        raise APIError("client disconnected", 499)
    return work.result()


def build_app(client: EngineClient, cfg: ServeConfig, model_dir: Optional[str]) -> FastAPI:
    name = client.model_name
    chat = ChatPrompts(model_dir, client.tokenizer, cfg.chat_template)

    @asynccontextmanager
    async def lifespan(_):
        yield
        client.shutdown()  # what still runs is aborted

    app = FastAPI(title="megainfer", version=version(), lifespan=lifespan)
    app.state.client = client
    errors.install(app)

    async def auth(request: Request) -> None:
        if cfg.api_key is None:
            return
        got = request.headers.get("authorization", "")
        if not secrets.compare_digest(got.encode(), f"Bearer {cfg.api_key}".encode()):
            raise APIError("missing or wrong API key (Authorization: Bearer <key>)", 401,
                           code="invalid_api_key")

    def check_model(model: Optional[str]) -> None:
        if model is not None and model != name:
            raise APIError(f"model={model!r}: not served here (this server serves {name!r})",
                           404, "model", "model_not_found")

    def stream_response(events, slot) -> StreamingResponse:
        async def body():
            try:
                async for chunk in events:
                    yield chunk
            finally:
                slot.release()
        return StreamingResponse(body(), media_type="text/event-stream",
                                 background=BackgroundTask(slot.release))

    @app.post("/v1/completions", dependencies=[Depends(auth)])
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        if body.suffix:
            raise APIError("suffix: not supported", 400, "suffix")
        if body.best_of is not None and body.best_of != body.n:
            raise APIError(f"best_of={body.best_of}: only best_of == n is served", 400,
                           "best_of")
        prompts = body.prompts()
        echo_lp = body.logprobs if body.echo and body.logprobs is not None else None
        asked = [k for k in (echo_lp, body.prompt_logprobs) if k is not None]
        prompt_k = max(asked) if asked else None  # the engine's prompt logprobs serve both
        work = []
        for p in prompts:
            ids = client.check_prompt(p, body.sampling_params(1, None))
            params = body.sampling_params(client.token_budget(ids, body.max_tokens,
                                                              "max_tokens"),
                                          body.logprobs, prompt_k)
            echo = (p if isinstance(p, str) else client.tokenizer.decode(ids)) \
                if body.echo else None
            work.append((ids, params, echo))
        rid = body.request_id or f"cmpl-{uuid.uuid4().hex}"
        slot = client.admit(len(work))
        try:
            streams = [client.generate(ids, params, f"{rid}-{i}")
                       for i, (ids, params, _) in enumerate(work)]
            if body.stream:
                so = body.stream_options
                return stream_response(completion_events(
                    merged(streams), rid, name, body.n,
                    [e for _, _, e in work] if body.echo else None, body.logprobs,
                    bool(so and so.include_usage), bool(so and so.continuous_usage_stats)), slot)
            finals = await unless_disconnected(request, _finals(streams))
        finally:
            if not body.stream:
                slot.release()
        choices = []
        for i, (ids, _, echo) in enumerate(work):
            out = finals[i]
            for c in out.outputs:
                lp = None
                if body.logprobs is not None:
                    lp = R.completion_logprobs(c.logprobs or [], c.token_ids, body.logprobs,
                                               len(echo or ""))
                    if body.echo:
                        lp = R.merge_logprobs(R.completion_logprobs(
                            out.prompt_logprobs or [None] * len(ids), ids, body.logprobs), lp)
                plp = None if body.prompt_logprobs is None else R.prompt_logprobs(
                    out.prompt_logprobs, ids, body.prompt_logprobs)
                choices.append(R.completion_choice(i * body.n + c.index, c,
                                                   (echo or "") + c.text, lp, plp))
        return R.envelope(rid, "text_completion", name, R.now(), choices,
                          R.usage(*R.tokens_of([finals[i] for i in range(len(work))])))

    @app.post("/v1/chat/completions", dependencies=[Depends(auth)])
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        if body.tools:
            raise APIError("tools: tool calling is not supported", 400, "tools")
        if body.response_format and body.response_format.get("type") != "text":
            raise APIError("response_format: only {'type': 'text'} is supported", 400,
                           "response_format")
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError("top_logprobs: needs logprobs=true", 400, "top_logprobs")
        if not chat.available:
            raise APIError("this model has no chat template (start the server with "
                           "serve.chat_template=...)", 400, "messages")
        _, ids = chat.render(body.messages, body.add_generation_prompt)
        top = (body.top_logprobs or 0) if body.logprobs else None
        ids = client.check_prompt(ids, body.sampling_params(1, None), "messages")
        field = "max_completion_tokens" if body.max_completion_tokens is not None \
            else "max_tokens"
        params = body.sampling_params(client.token_budget(ids, body.token_budget(), field),
                                      top, body.prompt_logprobs)
        rid = body.request_id or f"chatcmpl-{uuid.uuid4().hex}"
        slot = client.admit(1)
        try:
            stream = client.generate(ids, params, rid)
            if body.stream:
                so = body.stream_options
                return stream_response(chat_events(
                    merged([stream]), rid, name, body.n, top, bool(so and so.include_usage),
                    bool(so and so.continuous_usage_stats)), slot)
            out = (await unless_disconnected(request, _finals([stream])))[0]
        finally:
            if not body.stream:
                slot.release()
        choices = [R.chat_choice(c.index, c, None if top is None else
                                 R.chat_logprobs(c.logprobs or [], c.token_ids, top))
                   for c in out.outputs]
        res = R.envelope(rid, "chat.completion", name, R.now(), choices,
                         R.usage(*R.tokens_of([out])))
        if body.prompt_logprobs is not None:  # vLLM's field, beside the choices
            res["prompt_logprobs"] = R.prompt_logprobs(out.prompt_logprobs, ids,
                                                       body.prompt_logprobs)
        return res

    @app.get("/v1/models", dependencies=[Depends(auth)])
    async def models():
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": R.now(), "owned_by": "megainfer",
            "root": model_dir or name, "parent": None, "max_model_len": client.max_model_len}]}

    @app.post("/tokenize", dependencies=[Depends(auth)])
    async def tokenize(body: TokenizeRequest):
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError("give exactly one of prompt and messages", 400, "prompt")
        if body.messages is not None:
            _, ids = chat.render(body.messages, body.add_generation_prompt)
        else:
            ids = list(client.tokenizer.encode(body.prompt))
        return {"tokens": ids, "count": len(ids), "max_model_len": client.max_model_len}

    @app.post("/detokenize", dependencies=[Depends(auth)])
    async def detokenize(body: DetokenizeRequest):
        check_model(body.model)
        V = client.vocab_size
        bad = next((i for i, t in enumerate(body.tokens) if not 0 <= t < V), None)
        if bad is not None:
            raise APIError(f"tokens[{bad}]={body.tokens[bad]}: must be in [0, vocab_size={V})",
                           400, "tokens")
        return {"prompt": client.tokenizer.decode(body.tokens)}

    @app.get("/health")
    async def health():
        ok = client.answering() and not client.draining
        return Response(status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(client.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def get_version():
        return JSONResponse({"version": version()})

    return app


async def _finals(streams) -> dict:
    """Each stream's last (finished) output, by index."""
    out = {}
    async for i, o in merged(streams):
        if o.finished:
            out[i] = o
    return out
