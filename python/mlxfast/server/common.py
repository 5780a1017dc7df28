"""Small helpers shared by the route modules, and the one place request
bodies are parsed: strict JSON, then a walk that rejects what the engine's
native types and UTF-8 cannot hold (deep nesting, NaN, lone surrogates,
integers beyond 64 bits), naming the field."""

from __future__ import annotations

import asyncio
import json
import math
import secrets
import string
from typing import Any, Callable, TypeVar

from fastapi import Request
from pydantic import BaseModel

from ..text.tool_calls import finite
from .errors import APIError, bad_request

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")

_ALPHABET = string.ascii_letters + string.digits

# Deeper than any real request (a JSON schema or tool arguments); pydantic
# and the template renderer recurse, so depth is capped before they run.
MAX_JSON_DEPTH = 128
# Integers in a body fit 64 bits (signed or unsigned): seeds, token ids and
# counts all become C integers in the engine.
_INT_MIN, _INT_MAX = -(1 << 63), (1 << 64) - 1


def state_of(request: Request):
    """The server's state (``ServerState``) behind a route."""
    return request.app.state.mlxfast


async def ready_body(request: Request, model: type[M]):
    """A model route's preamble: ``(state, body)``, with a 503 while the model
    is not loaded and a 400 for a body ``model`` cannot take."""
    state = state_of(request)
    state.require_ready()
    return state, await parse_body(request, model)


def new_id(prefix: str, n: int = 24) -> str:
    return prefix + "".join(secrets.choice(_ALPHABET) for _ in range(n))


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON (numbers must be finite)")


def _where(node) -> str:
    """The field path of a walk node ``(parent node, key)``: ``messages[0].content``."""
    keys = []
    while node is not None:
        node, key = node
        keys.append(key)
    out = ""
    for k in reversed(keys):
        # A key may be the bad string itself: escape it, so the error can be encoded.
        out += f"[{k}]" if isinstance(k, int) else ("." if out else "") + k.encode(
            "utf-8", "backslashreplace").decode("utf-8")
    return out


def _reject(node, problem: str):
    where = _where(node)
    raise bad_request(f"{where or 'the request body'} {problem}", param=where or None)


def _check_string(s: str, node) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        _reject(node, "contains a lone UTF-16 surrogate (\\ud800-\\udfff): strings must be valid Unicode")


def check_json_value(value: Any) -> None:
    """Reject values the engine cannot represent: nesting deeper than
    MAX_JSON_DEPTH, strings (and object keys) that are not valid Unicode,
    integers outside 64 bits. Iterative, so hostile depth cannot recurse;
    field paths are built only for the error."""
    stack = [(value, None, 0)]
    while stack:
        v, node, depth = stack.pop()
        if isinstance(v, str):
            _check_string(v, node)
        elif isinstance(v, float):
            if not math.isfinite(v):  # NaN and Infinity are refused by name; 1e400 parses as inf
                _reject(node, "holds a number too large to be finite")
        elif isinstance(v, bool) or v is None:
            continue
        elif isinstance(v, int):
            if not _INT_MIN <= v <= _INT_MAX:
                digits = str(v)
                _reject(node, f"holds the integer {digits if len(digits) <= 20 else digits[:20] + '...'}, "
                              "which does not fit in 64 bits")
        elif isinstance(v, (dict, list)):
            if depth >= MAX_JSON_DEPTH:
                _reject(node, f"is nested more than {MAX_JSON_DEPTH} levels deep")
            items = v.items() if isinstance(v, dict) else enumerate(v)
            for k, x in items:
                if isinstance(k, str):
                    _check_string(k, (node, k))
                stack.append((x, (node, k), depth + 1))


def loads_body(raw: bytes) -> dict:
    """A request body as a JSON object, or a 400 that says what is wrong."""
    if not raw.strip():
        raise bad_request("the request body is empty; expected a JSON object")
    try:
        text = raw.decode("utf-8")  # JSON bodies are UTF-8 (RFC 8259); json.loads would guess UTF-16/32
    except UnicodeDecodeError:
        raise bad_request("request body is not valid UTF-8") from None
    try:
        data = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise bad_request(f"the request body is nested more than {MAX_JSON_DEPTH} levels deep") from None
    except json.JSONDecodeError as e:
        raise bad_request(f"request body is not valid JSON: {e}") from None
    except ValueError as e:  # NaN/Infinity, or an integer beyond Python's digit limit
        raise bad_request(f"request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    check_json_value(data)
    return data


def loads_field(text: str, what: str, param: str, *, model_output: bool = False) -> Any:
    """JSON held in a string field (a tool call's arguments, a schema sent
    as text) under the body's rules (finite numbers, 64-bit integers, valid
    Unicode, bounded depth); a 400 naming ``what`` and ``param`` otherwise.
    ``model_output``: text a model wrote (a past call's arguments, sent
    back), whose numbers beyond a double or NaN/Infinity become null, as the
    server's own answers write them (``tool_calls.finite``): an agent sends
    back what it was given."""
    try:
        value = json.loads(text, parse_constant=None if model_output else _reject_constant)
        if model_output:
            value = finite(value)
    except RecursionError:
        raise bad_request(f"{what} is nested more than {MAX_JSON_DEPTH} levels deep", param) from None
    except json.JSONDecodeError:
        raise bad_request(f"{what} is not valid JSON", param) from None
    except ValueError as e:  # NaN/Infinity, or an integer beyond Python's digit limit
        raise bad_request(f"{what} is not valid JSON: {e}", param) from None
    try:
        check_json_value(value)
    except APIError as e:
        raise bad_request(f"{what}: {e.message}", param) from None
    return value


# Bodies above this are parsed and validated in a worker thread.
_INLINE_BODY_BYTES = 64 << 10


async def parse_body(request: Request, model: type[M]) -> M:
    """The body as ``model``; any problem is a 400 (via the ValidationError handler)."""
    raw = await request.body()
    if len(raw) < _INLINE_BODY_BYTES:
        return model.model_validate(loads_body(raw))
    return await off_loop(lambda: model.model_validate(loads_body(raw)))


async def off_loop(fn: Callable[..., T], *args, **kwargs) -> T:
    """Run ``fn`` in a worker thread: template rendering and tokenization of a
    large request must not hold up the event loop (and /health) meanwhile."""
    return await asyncio.to_thread(fn, *args, **kwargs)
