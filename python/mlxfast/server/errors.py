"""API errors in OpenAI's and Anthropic's shapes, and the handlers that make
every failure (validation, unknown route, oversized body, engine state) one
of them. FastAPI's 422 never reaches a client."""

from __future__ import annotations

import json
import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

log = logging.getLogger("mlxfast.server")

# OpenAI error type -> Anthropic error type
_ANTHROPIC_TYPES = {
    "invalid_request_error": "invalid_request_error",
    "authentication_error": "authentication_error",
    "permission_error": "permission_error",
    "not_found_error": "not_found_error",
    "request_too_large": "request_too_large",
    "rate_limit_error": "rate_limit_error",
    "server_error": "api_error",
    "overloaded_error": "overloaded_error",
    "memory_admission": "invalid_request_error",
}

_STATUS_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


# An error message quotes the request at most this much (a 1 MB id came back whole).
MAX_MESSAGE_CHARS = 2000


def _bounded(message: str) -> str:
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    return message[:MAX_MESSAGE_CHARS] + f"... ({len(message) - MAX_MESSAGE_CHARS} more characters)"


class APIError(Exception):
    """An error answered to the client as JSON (shape chosen by the route)."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        message = _bounded(message)
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _STATUS_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.param = param
        self.code = code
        self.headers = headers or {}

    def openai_body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict:
        return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(self.type, self.type), "message": self.message}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param=param, code=code)


def is_anthropic_path(path: str) -> bool:
    return path.startswith("/v1/messages") or path.startswith("/anthropic/")


def error_response(request_path: str, err: APIError) -> JSONResponse:
    body = err.anthropic_body() if is_anthropic_path(request_path) else err.openai_body()
    return JSONResponse(body, status_code=err.status, headers=err.headers)


# Parts of a pydantic error location that name a member of a union (``str``,
# ``list[dict[any,any]]``, ``NamedToolChoice``), not a field.
_UNION_MEMBER = re.compile(r"^(?:str|int|float|bool|dict|list|none|bytes)$|\[|^[A-Z]")


def _loc(loc) -> str:
    parts = [str(p) for p in loc if p != "body" and not (isinstance(p, str) and _UNION_MEMBER.search(p))]
    out = ""
    for p in parts:
        if p.isdigit():
            out += f"[{p}]"
        else:
            out += ("." if out else "") + p
    return out


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """One readable sentence from pydantic errors, and the offending field."""
    if not errors:
        return "invalid request", None
    e = errors[0]
    param = _loc(e.get("loc", ())) or getattr((e.get("ctx") or {}).get("error"), "param", None)
    msg = e.get("msg", "invalid value")
    if e.get("type") == "json_invalid":
        return "request body is not valid JSON", None
    if e.get("type") == "missing":
        return f"'{param}' is a required field", param
    if e.get("type") == "extra_forbidden":
        return f"unknown field '{param}'", param
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    return (f"{param}: {msg}" if param else msg), param


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(request.url.path, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        msg, param = validation_message(list(exc.errors()))
        return error_response(request.url.path, bad_request(msg, param))

    @app.exception_handler(ValidationError)
    async def _pyd_validation(request: Request, exc: ValidationError):
        msg, param = validation_message(exc.errors())
        return error_response(request.url.path, bad_request(msg, param))

    @app.exception_handler(json.JSONDecodeError)
    async def _json(request: Request, exc: json.JSONDecodeError):
        return error_response(request.url.path, bad_request(f"request body is not valid JSON: {exc.msg}"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        headers = dict(exc.headers or {})
        if exc.status_code == 404:
            msg = f"unknown route {request.method} {request.url.path}"
        elif exc.status_code == 405:
            msg = f"method {request.method} not allowed on {request.url.path}"
            headers["Allow"] = ", ".join(allowed_methods(request))
        else:
            msg = str(exc.detail)
        return error_response(request.url.path, APIError(exc.status_code, msg, headers=headers))

    app.add_middleware(_Unexpected)


_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE")


def allowed_methods(request: Request) -> list[str]:
    """Every method some route takes at this path. (Starlette's 405 names
    the first matching route's only: ``/v1/responses/{id}`` has a GET route
    and a DELETE route.) HEAD goes wherever GET does (``_HeadAsGet``)."""
    def takes(method: str) -> bool:
        scope = {**request.scope, "method": "GET" if method == "HEAD" else method}
        return any(route.matches(scope)[0] == Match.FULL for route in request.app.router.routes)
    return [m for m in _METHODS if takes(m)]


class _Unexpected:
    """ASGI middleware: an exception no handler took becomes a 500 in the
    API's error shape, and the connection stays usable. (Starlette's
    handler for ``Exception`` answers, then re-raises to the server, which
    drops the keep-alive connection: a client's next request on it failed.)
    Once a response has started (a stream) nothing more can be said: that
    one is re-raised."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracked(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as exc:  # noqa: BLE001  (the last resort)
            if started:
                raise
            log.exception("unhandled error on %s", scope.get("path", ""))
            await error_response(scope.get("path", ""), APIError(500, f"internal error: {exc}", "server_error"))(
                scope, receive, send)
