"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with the HTTP
status, for every refusal (ours, pydantic's, the engine's ``RequestError``, starlette's) and for
a stream's error event. ``type`` is OpenAI's (``invalid_request_error``, ``server_error``, ...),
``code`` a string or null. docs/serve.md, "Errors"."""
from __future__ import annotations

import re
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from megainfer.engine import RequestError
from megainfer.engine.errors import DuplicateRequestError, EmptyPromptError, PromptTooLongError, TokenIdError
from megainfer.engine.failures import EngineDeadError

# OpenAI's error types by status; anything else 4xx is an invalid request, 5xx a server error
TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
         429: "rate_limit_error", 503: "service_unavailable_error"}
# the code of a refusal that names none (a string, as OpenAI's are)
CODES = {400: "invalid_request", 401: "invalid_api_key", 404: "not_found",
         405: "method_not_allowed", 408: "request_timeout", 413: "request_too_large",
         500: "internal_error", 503: "service_unavailable"}
_FIELD = re.compile(r"^([A-Za-z_][\w\[\]\.]*)=")
BEARER = {"WWW-Authenticate": "Bearer"}


def error_type(status: int) -> str:
    return TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


class APIError(Exception):
    """A refusal with its HTTP status; ``param`` names the field at fault."""

    def __init__(self, message: str, status: int = 400, param: Optional[str] = None,
                 code: Optional[str] = None, headers: Optional[dict] = None):
        super().__init__(message)
        self.message, self.status, self.param, self.headers = message, status, param, headers
        self.code = code or CODES.get(status)


def error_body(message: str, status: int = 500, param: Optional[str] = None,
               code: Optional[str] = None) -> dict:
    """The error object, as a response body or as one SSE event."""
    return {"error": {"message": message, "type": error_type(status), "param": param,
                      "code": code or CODES.get(status)}}


def error_response(status: int, message: str, param: Optional[str] = None,
                   code: Optional[str] = None, headers: Optional[dict] = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param, code), status_code=status,
                        headers=headers)


def api_error_response(e: APIError) -> JSONResponse:
    return error_response(e.status, e.message, e.param, e.code, e.headers)


def request_error(e: RequestError, prompt_field: str = "prompt") -> APIError:
    """The engine's refusal of one request, as a 400 naming the field its message names."""
    if isinstance(e, (PromptTooLongError, EmptyPromptError, TokenIdError)):
        param = prompt_field
    elif isinstance(e, DuplicateRequestError):
        param = "request_id"
    else:
        m = _FIELD.match(str(e))
        param = m.group(1) if m else None
    return APIError(str(e), 400, param)


def stream_error(e: BaseException) -> dict:
    """A stream's error event: a refused request (400), an engine that died (503), a bug
    (500, logged once by the caller)."""
    if isinstance(e, APIError):
        return error_body(e.message, e.status, e.param, e.code)
    if isinstance(e, RequestError):
        err = request_error(e)
        return error_body(err.message, 400, err.param)
    if isinstance(e, EngineDeadError):
        return error_body(f"engine is not running: {type(e).__name__}: {e}", 503,
                          code="engine_dead")
    return error_body(f"internal server error: {type(e).__name__}: {e}", 500)


def _validation(exc: RequestValidationError) -> JSONResponse:
    errs = exc.errors()
    first = errs[0] if errs else {}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    if first.get("type") == "json_invalid":
        return error_response(400, f"malformed JSON body: {first.get('msg', '')}", None,
                              "json_invalid")
    param = ".".join(loc) or None
    msg = "; ".join(f"{'.'.join(str(x) for x in e.get('loc', ()) if x != 'body') or 'body'}: "
                    f"{e.get('msg', 'invalid')}" for e in errs[:5])
    return error_response(400, msg, param, "invalid_value")


def install(app: FastAPI) -> None:
    """Every refusal of ``app`` in OpenAI's shape (an unexpected exception: ``gate``)."""

    @app.exception_handler(APIError)
    async def _api(_: Request, e: APIError):
        return api_error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError):
        return _validation(e)

    @app.exception_handler(RequestError)
    async def _engine(_: Request, e: RequestError):
        err = request_error(e)
        return error_response(400, err.message, err.param)

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, e: EngineDeadError):  # the engine core died (a rank lost)
        return error_response(503, f"engine is not running: {e}", code="engine_dead")

    @app.exception_handler(HTTPException)
    async def _http(_: Request, e: HTTPException):
        return error_response(e.status_code, str(e.detail), headers=e.headers)
