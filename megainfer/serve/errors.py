"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with the HTTP
status, for every refusal (ours, pydantic's, the engine's ``RequestError``, starlette's)."""
from __future__ import annotations

import re
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from megainfer.engine.errors import EngineDeadError
from megainfer.engine import RequestError
from megainfer.engine.errors import EmptyPromptError, PromptTooLongError, TokenIdError

TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
         405: "MethodNotAllowed", 500: "InternalServerError", 503: "ServiceUnavailableError"}
_FIELD = re.compile(r"^([A-Za-z_][\w\[\]\.]*)=")


class APIError(Exception):
    """A refusal with its HTTP status; ``param`` names the field at fault."""

    def __init__(self, message: str, status: int = 400, param: Optional[str] = None,
                 code: Optional[str] = None, headers: Optional[dict] = None):
        super().__init__(message)
        self.message, self.status, self.param, self.headers = message, status, param, headers
        self.code = code or TYPES.get(status, "error")


def error_response(status: int, message: str, param: Optional[str] = None,
                   code: Optional[str] = None, headers: Optional[dict] = None) -> JSONResponse:
    body = {"error": {"message": message, "type": TYPES.get(status, "error"), "param": param,
                      "code": code or status}}
    return JSONResponse(body, status_code=status, headers=headers)


def error_body(message: str, status: int = 500) -> dict:
    """The same shape as one SSE event (an error in the middle of a stream)."""
    return {"error": {"message": message, "type": TYPES.get(status, "error"), "param": None,
                      "code": status}}


def request_error(e: RequestError, prompt_field: str = "prompt") -> APIError:
    """The engine's refusal of one request, as a 400 naming the field its message names."""
    if isinstance(e, (PromptTooLongError, EmptyPromptError, TokenIdError)):
        param = prompt_field
    else:
        m = _FIELD.match(str(e))
        param = m.group(1) if m else None
    return APIError(str(e), 400, param)


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
    return error_response(400, msg, param, "invalid_request")


def install(app: FastAPI) -> None:
    """Every refusal of ``app`` in OpenAI's shape."""

    @app.exception_handler(APIError)
    async def _api(_: Request, e: APIError):
        return error_response(e.status, e.message, e.param, e.code, e.headers)

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
        return error_response(e.status_code, str(e.detail), headers=getattr(e, "headers", None))
