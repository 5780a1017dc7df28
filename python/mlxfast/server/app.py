"""The FastAPI app: routers, error handlers, API-key check, body-size cap,
and the browser checks (Host header, cross-site writes)."""

from __future__ import annotations

import hmac
import ipaddress
import json
from urllib.parse import urlsplit

from fastapi import FastAPI
from fastapi.routing import APIRoute
from fastapi.middleware.cors import CORSMiddleware

from . import admin, anthropic, openai, responses, webui
from .errors import APIError, install_handlers, is_anthropic_path
from .state import ServerState

_PROTECTED = ("/v1/", "/tokenize", "/detokenize", "/stats", "/admin/",
              "/chat/", "/completions", "/models", "/responses")  # the last: _alias_without_v1's
_PUBLIC = ("/v1/health",)  # llama.cpp's alias of /health, public as /health is


def _credential(headers: dict[str, str]) -> str | None:
    """The first non-empty credential: ``x-api-key``, then ``Authorization:
    Bearer`` (an empty header a client library adds must not hide the other)."""
    key = headers.get("x-api-key", "").strip()
    if key:
        return key
    auth = headers.get("authorization", "")
    if auth[:7].lower() == "bearer " and auth[7:].strip():
        return auth[7:].strip()
    return None


def host_name(host: str) -> str:
    """The name in a Host header (no port, no IPv6 brackets), lower case."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def is_loopback(name: str) -> bool:
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def host_allowed(host: str | None, allowed: tuple[str, ...] | None) -> bool:
    """Whether a request's Host header names this server. ``allowed`` None:
    any; otherwise loopback names and ``allowed`` (names as ``host_name``
    gives them; a page of another site whose name resolves to 127.0.0.1,
    DNS rebinding, names itself)."""
    if allowed is None or host is None or "*" in allowed:
        return True
    name = host_name(host)
    return is_loopback(name) or name in allowed


def cross_site(headers: dict[str, str], allowed_origins: tuple[str, ...]) -> str | None:
    """The Origin of a browser request from another site (a page there may
    send "simple" POSTs that need no CORS preflight), unless allowed; None
    for same-origin requests and for clients that send no Origin (SDKs, curl)."""
    origin = headers.get("origin")
    if origin is None or "*" in allowed_origins or origin in allowed_origins:
        return None
    if headers.get("sec-fetch-site") in ("same-origin", "none"):  # the browser's word (pages cannot set it)
        return None
    netloc = urlsplit(origin).netloc.lower() if origin != "null" else ""
    hosts = {headers.get("host", ""), headers.get("x-forwarded-host", "").split(",")[0]}  # behind a proxy
    if netloc and netloc in {h.strip().lower() for h in hosts if h}:
        return None
    return origin


async def _drain(receive, limit: int) -> None:
    seen = 0
    while seen <= limit:
        msg = await receive()
        if msg["type"] != "http.request":
            return
        seen += len(msg.get("body", b""))
        if not msg.get("more_body"):
            return


class _Guard:
    """ASGI middleware: 400 for a Host this server does not answer to, 403
    for a write from another site's page, 401 without the API key, 413 over
    the body cap."""

    def __init__(self, app, state: ServerState):
        self.app = app
        self.state = state

    async def _reply(self, scope, send, err: APIError):
        body = err.anthropic_body() if is_anthropic_path(scope["path"]) else err.openai_body()
        raw = json.dumps(body).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
        headers += [(k.lower().encode(), v.encode()) for k, v in err.headers.items()]
        await send({"type": "http.response.start", "status": err.status, "headers": headers})
        await send({"type": "http.response.body", "body": raw})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        s = self.state.settings
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        path = scope["path"]
        if not host_allowed(headers.get("host"), s.allowed_hosts):
            return await self._reply(scope, send, APIError(
                400, f"this server does not answer to host {headers['host'][:100]!r} "
                     "(start it with --allowed-hosts to add names)", "invalid_request_error"))
        origin = cross_site(headers, s.allowed_origins) if scope["method"] not in ("GET", "HEAD", "OPTIONS") else None
        if origin is not None:
            return await self._reply(scope, send, APIError(
                403, f"a request from the page at {origin[:100]!r} was refused: another site's page may "
                     "not use this server (allow it with --allowed-origins)", "permission_error"))
        if s.api_key and path not in _PUBLIC and (path.startswith(_PROTECTED) or (s.metrics_require_key and path == "/metrics")):
            given = _credential(headers)
            if given is None or not hmac.compare_digest(given.encode(), s.api_key.encode()):
                msg = "invalid API key" if given else "missing API key (send 'Authorization: Bearer <key>' or 'x-api-key')"
                return await self._reply(scope, send, APIError(401, msg, "authentication_error", code="invalid_api_key"))
        cap = s.max_body_bytes
        too_large = APIError(413, f"request body exceeds the server's limit of {cap} bytes", "request_too_large")
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > cap:
            # Read (and drop) what the client is sending first, up to a bound:
            # closing on a client still writing resets the connection before
            # it can read the 413.
            await _drain(receive, max(4 * cap, 64 << 20))
            return await self._reply(scope, send, too_large)
        seen = 0

        async def capped_receive():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > cap:
                    raise too_large
            return msg

        return await self.app(scope, capped_receive, send)


def _alias_without_v1(app: FastAPI) -> None:
    """The OpenAI routes also without their /v1 prefix, as llama.cpp's
    server has them: a client given the server's root as its base URL
    (``http://127.0.0.1:8080``) asks for ``/chat/completions``."""
    for router in (openai.router, responses.router):
        for route in router.routes:
            if isinstance(route, APIRoute) and route.path.startswith("/v1/"):
                app.add_api_route(route.path[3:], route.endpoint, methods=list(route.methods),
                                  include_in_schema=False)


class _HeadAsGet:
    """ASGI middleware: HEAD is answered as GET without the body, as
    Starlette's own routes do (FastAPI's take only the methods they name):
    load balancers and uptime checks probe ``HEAD /health``."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "HEAD":
            return await self.app(scope, receive, send)

        async def headers_only(message):
            if message["type"] == "http.response.body":
                if message.get("more_body", False):
                    return
                message = {"type": "http.response.body", "body": b"", "more_body": False}
            await send(message)

        await self.app({**scope, "method": "GET"}, receive, headers_only)


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="mlxfast", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.mlxfast = state
    install_handlers(app)
    app.include_router(openai.router)
    app.include_router(anthropic.router)
    app.include_router(responses.router)
    app.include_router(admin.router)
    _alias_without_v1(app)
    if state.settings.webui:
        app.include_router(webui.router)  # the chat page at /
    app.add_middleware(_Guard, state=state)
    app.add_middleware(_HeadAsGet)
    origins = state.settings.allowed_origins
    if origins:
        # Outside the guard: a browser's preflight carries no credentials, and
        # a 401 or 413 must carry CORS headers for the page to read it.
        app.add_middleware(CORSMiddleware, allow_origins=list(origins), allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["Retry-After"], max_age=600)
    return app
