"""Requests that fail below the app, in the HTTP parser (an invalid or
conflicting Content-Length, a malformed request line): uvicorn answers those
itself with a plain-text 400. This protocol answers them in the API's own
error shape instead, chosen from the request line's path when it can be read."""

from __future__ import annotations

import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .errors import APIError, is_anthropic_path

_HEAD_BYTES = 8192  # enough for a request line


class JSONErrorH11Protocol(H11Protocol):
    def data_received(self, data: bytes) -> None:
        if self.conn.our_state in (h11.IDLE, h11.DONE) or not getattr(self, "_head", b""):
            self._head = data[:_HEAD_BYTES]
        super().data_received(data)

    def send_400_response(self, msg: str) -> None:
        head = getattr(self, "_head", b"")
        parts = head.split(b"\r\n", 1)[0].split(b" ")
        path = parts[1].decode("latin-1") if len(parts) >= 2 else "/"
        err = APIError(400, f"malformed HTTP request: {msg}", "invalid_request_error")
        body = json.dumps(err.anthropic_body() if is_anthropic_path(path) else err.openai_body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        self.transport.write(self.conn.send(h11.Response(status_code=400, headers=headers, reason=b"Bad Request")))
        self.transport.write(self.conn.send(h11.Data(data=body)))
        self.transport.write(self.conn.send(h11.EndOfMessage()))
        self.transport.close()
