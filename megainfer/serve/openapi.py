"""The OpenAPI document as the server answers: every refusal's status with OpenAI's error
schema (400 where FastAPI would say 422: a bad field is a 400 here), the streamed answers'
``text/event-stream``, the bearer scheme on the paths that need the key, and the plain-text
bodies of ``/health`` and ``/metrics``."""
from __future__ import annotations

from typing import Callable

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from megainfer.config import ServeConfig

ERROR_SCHEMA = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]},
                       "code": {"type": ["string", "null"]}}}}}
# one server-sent event (its ``data``: a chunk object's JSON, or ``[DONE]``)
SSE_EVENT = {"type": "object", "properties": {"data": {"type": "string"},
                                              "event": {"type": "string"},
                                              "id": {"type": "string"},
                                              "retry": {"type": "integer"}}}
_WHY = {400: "A bad or unknown field, a value out of range, a prompt too long",
        401: "Missing or wrong API key", 404: "Unknown model or path",
        408: "The client paused too long inside its body",
        413: "Body larger than serve.max_body_bytes",
        503: "Queue full, draining or engine dead (with Retry-After)"}


def _errors(*statuses: int) -> dict:
    return {s: {"description": _WHY[s],
                "content": {"application/json": {"schema": ERROR_SCHEMA}}} for s in statuses}


BODY_ERRORS = _errors(400, 401, 404, 408, 413, 503)
GET_ERRORS = _errors(401, 404)


def text_response(media_type: str, *statuses: int) -> dict:
    return {s: {"description": "OK" if s < 300 else "Not serving",
                "content": {media_type: {"schema": {"type": "string"}}}} for s in statuses}


def _operation(op: dict, secured: bool) -> None:
    res = op.get("responses", {})
    res.pop("422", None)
    ok = res.get("200", {}).get("content", {})
    if "requestBody" in op and "application/json" in ok:  # stream=true answers SSE
        ok["text/event-stream"] = {"schema": SSE_EVENT}
    if secured:
        op["security"] = [{"bearer": []}]
    else:
        res.pop("401", None)


def install_openapi(app: FastAPI, cfg: ServeConfig, protected: Callable[[str], bool]) -> None:
    def openapi() -> dict:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            doc.setdefault("components", {}).setdefault("securitySchemes", {})["bearer"] = {
                "type": "http", "scheme": "bearer"}
            for path, ops in doc.get("paths", {}).items():
                secured = cfg.api_key is not None and protected(path)
                for op in ops.values():
                    _operation(op, secured)
            for name in ("HTTPValidationError", "ValidationError"):
                doc["components"].get("schemas", {}).pop(name, None)
            app.openapi_schema = doc
        return app.openapi_schema
    app.openapi = openapi
