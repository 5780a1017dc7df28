"""Small helpers shared by the route modules."""

from __future__ import annotations

import json
import secrets
import string
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel

from .errors import bad_request

M = TypeVar("M", bound=BaseModel)

_ALPHABET = string.ascii_letters + string.digits


def new_id(prefix: str, n: int = 24) -> str:
    return prefix + "".join(secrets.choice(_ALPHABET) for _ in range(n))


async def read_json(request: Request) -> dict:
    raw = await request.body()
    if not raw.strip():
        raise bad_request("the request body is empty; expected a JSON object")
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    return data


async def parse_body(request: Request, model: type[M]) -> M:
    """The body as ``model``; any problem is a 400 (via the ValidationError handler)."""
    return model.model_validate(await read_json(request))
