"""Server-sent events framing, and a heartbeat wrapper over event streams."""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator

from fastapi.responses import StreamingResponse

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "Connection": "keep-alive"}


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def data_event(obj: Any) -> bytes:
    """OpenAI framing: ``data: <json>\\n\\n``."""
    return f"data: {_dumps(obj)}\n\n".encode()


DONE = b"data: [DONE]\n\n"


def named_event(name: str, obj: Any) -> bytes:
    """Anthropic framing: ``event: <name>\\ndata: <json>\\n\\n``."""
    return f"event: {name}\ndata: {_dumps(obj)}\n\n".encode()


def sse_response(body: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)


class Heartbeat:
    """Marker yielded by ``with_heartbeat`` when no event came for a while."""


HEARTBEAT = Heartbeat()


async def with_heartbeat(stream: AsyncIterator[Any], interval: float) -> AsyncIterator[Any]:
    """Yield the items of ``stream``; yield ``HEARTBEAT`` after every
    ``interval`` seconds without one. The stream is consumed by one task, so a
    timeout never cancels it halfway through an item."""
    it = stream.__aiter__()
    pending: asyncio.Task | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(it.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=interval)
            if not done:
                yield HEARTBEAT
                continue
            task, pending = pending, None
            try:
                item = task.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if pending is not None and not pending.done():
            pending.cancel()
