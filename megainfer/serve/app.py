"""The FastAPI application: OpenAI's /v1/completions, /v1/chat/completions and /v1/models,
vLLM's /tokenize, /detokenize, /health, /metrics and /version, and the live planner's /planner
(docs/serve.md). The routes only parse and delegate to one serving class per endpoint; the
key, the body's size and pace, and unexpected errors are the gate's (``gate.RequestGate``); the OpenAPI document declares what
the server really answers (``openapi.py``)."""
from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from importlib.metadata import PackageNotFoundError, version as package_version
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from megainfer.config import ServeConfig

from . import errors
from .chat import ChatPrompts
from .served_engine import ServedEngine
from .gate import RequestGate
from .openapi import BODY_ERRORS, GET_ERRORS, install_openapi, text_response
from .protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                       TokenizeRequest)
from .serving_base import ClientGone
from .serving_chat import ChatServing
from .serving_completions import CompletionServing
from .serving_tokens import TokenServing

OPEN_PATHS = ("/health", "/version", "/docs", "/openapi.json", "/redoc")


def version() -> str:
    try:
        return package_version("megainfer")
    except PackageNotFoundError:  # pragma: no cover - a source tree without an install
        return "unknown"


def needs_key(cfg: ServeConfig):
    """path -> whether it needs the API key (when one is set)."""
    def protected(path: str) -> bool:
        if path == "/metrics":
            return cfg.metrics_require_key
        return path not in OPEN_PATHS
    return protected


def build_app(client: ServedEngine, cfg: ServeConfig, model_dir: Optional[str]) -> FastAPI:
    chat = ChatServing(client, cfg, ChatPrompts(model_dir, client.tokenizer, cfg.chat_template))
    completions = CompletionServing(client, cfg)
    tokens = TokenServing(chat, model_dir)

    @asynccontextmanager
    async def lifespan(_):
        planner = None if client.planner is None else asyncio.ensure_future(
            client.planner.run(client))
        yield
        if planner is not None:
            planner.cancel()
        client.shutdown()  # what still runs is aborted

    app = FastAPI(title="megainfer", version=version(), lifespan=lifespan)
    app.state.client = client
    errors.install(app)

    @app.exception_handler(ClientGone)
    async def _gone(_: Request, e: ClientGone):  # nobody reads it: the request was aborted
        return Response(status_code=499)

    @app.post("/v1/completions", responses=BODY_ERRORS)
    async def create_completion(body: CompletionRequest, request: Request):
        return await completions.create(body, request)

    @app.post("/v1/chat/completions", responses=BODY_ERRORS)
    async def create_chat_completion(body: ChatCompletionRequest, request: Request):
        return await chat.create(body, request)

    @app.get("/v1/models", responses=GET_ERRORS)
    async def list_models():
        return tokens.models()

    @app.get("/v1/models/{model_id:path}", responses=GET_ERRORS)
    async def retrieve_model(model_id: str):
        return tokens.model(model_id)

    @app.post("/tokenize", responses=BODY_ERRORS)
    async def tokenize(body: TokenizeRequest):
        return await tokens.tokenize(body)

    @app.post("/detokenize", responses=BODY_ERRORS)
    async def detokenize(body: DetokenizeRequest):
        return tokens.detokenize(body)

    @app.get("/health", response_class=Response,
             responses=text_response("text/plain", 200, 503))
    async def health():
        ok = client.answering() and not client.draining
        return Response(status_code=200 if ok else 503, media_type="text/plain")

    @app.get("/metrics", response_class=Response,
             responses={**text_response(CONTENT_TYPE_LATEST, 200), **GET_ERRORS})
    async def metrics():
        return Response(generate_latest(client.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/planner", responses=GET_ERRORS)
    async def planner():
        """The live planner's last decisions (``replan.policy=planner``; else 404)."""
        if client.planner is None:
            raise errors.APIError("no live planner runs (replan.policy=planner)", 404,
                                  code="not_found")
        return JSONResponse(client.planner.view())

    @app.get("/version")
    async def get_version():
        return JSONResponse({"version": version()})

    protected = needs_key(cfg)
    install_openapi(app, cfg, protected)
    app.add_middleware(RequestGate, api_key=cfg.api_key, protected=protected,
                       max_body_bytes=cfg.max_body_bytes, body_timeout_s=cfg.body_timeout_s)
    return app
