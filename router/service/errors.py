"""OpenAI-style error responses: `{"error": {"message", "type", "param", "code"}}` with a matching status."""

from __future__ import annotations

import json

from aiohttp import web


def error_body(message: str, *, type_: str, code: str | None = None, param: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": type_, "param": param, "code": code}}).encode()


def error_response(
    status: int,
    message: str,
    *,
    type_: str | None = None,
    code: str | None = None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    if type_ is None:
        type_ = "invalid_request_error" if status < 500 else "server_error"
    return web.Response(
        status=status,
        body=error_body(message, type_=type_, code=code, param=param),
        content_type="application/json",
        headers=headers,
    )


def sse_error_event(message: str, code: str = "upstream_error") -> bytes:
    """The event that ends a stream whose replica failed after bytes had reached the client."""
    return b"data: " + error_body(message, type_="server_error", code=code) + b"\n\n"
