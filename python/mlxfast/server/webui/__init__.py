"""The chat page: ``GET /`` and its static files under ``/webui/``.

Plain files shipped in this package (no build step, no CDN: the page works
offline). They are public like ``/health``: the API key guards ``/v1/...``,
and the page asks for it. Every response carries a Content-Security-Policy
that allows scripts, styles and connections from this origin only and no
inline script: if a model's reply ever got past the page's escaping, the
browser would still refuse to run what it carries.
"""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter
from fastapi.responses import Response

router = APIRouter()

# name -> media type: the only files served (no path is taken from the URL).
FILES = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "markdown.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}

CSP = "; ".join([
    "default-src 'none'",
    "script-src 'self'",
    "style-src 'self'",
    "connect-src 'self'",
    "img-src 'self' data:",
    "base-uri 'none'",
    "form-action 'none'",
    "frame-ancestors 'none'",
])

HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",  # frame-ancestors for browsers that predate it
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}

_cache: dict[str, bytes] = {}


def read(name: str) -> bytes:
    """A packaged file's bytes (read once)."""
    if name not in _cache:
        _cache[name] = resources.files(__name__).joinpath(name).read_bytes()
    return _cache[name]


def _file(name: str) -> Response:
    return Response(read(name), media_type=FILES[name], headers=HEADERS)


@router.get("/", include_in_schema=False)
async def index():
    return _file("index.html")


@router.get("/webui/{name}", include_in_schema=False)
async def static(name: str):
    if name not in FILES or name == "index.html":
        return Response(b"not found", status_code=404, media_type="text/plain", headers=HEADERS)
    return _file(name)
