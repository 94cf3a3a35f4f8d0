"""aiohttp's floor for the proxy benchmark: an aiohttp reverse proxy with no routing logic.

Round-robin over its upstreams, one pooled client session, the body read whole and forwarded, the answer streamed
back chunk by chunk. A router built on aiohttp's server and client costs at least this.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Iterator

import aiohttp
from aiohttp import web

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "transfer-encoding",
        "content-length",
        "host",
        "te",
        "trailer",
        "upgrade",
        "proxy-authorization",
        "proxy-authenticate",
        "content-encoding",
    }
)

UPSTREAMS: web.AppKey[Iterator[str]] = web.AppKey("upstreams")
SESSION = web.AppKey("session", aiohttp.ClientSession)


async def proxy(request: web.Request) -> web.StreamResponse:
    upstreams = request.app[UPSTREAMS]
    upstream = next(upstreams)
    body = await request.read()
    headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
    async with request.app[SESSION].request(
        request.method, upstream + request.path_qs, data=body, headers=headers
    ) as upstream_resp:
        response = web.StreamResponse(
            status=upstream_resp.status,
            headers={k: v for k, v in upstream_resp.headers.items() if k.lower() not in HOP_BY_HOP},
        )
        if upstream_resp.content_length is not None:
            response.content_length = upstream_resp.content_length
        await response.prepare(request)
        async for chunk in upstream_resp.content.iter_any():
            await response.write(chunk)
        await response.write_eof()
        return response


def create_app(upstreams: list[str]) -> web.Application:
    app = web.Application()
    app[UPSTREAMS] = itertools.cycle(u.rstrip("/") for u in upstreams)

    async def session_ctx(app: web.Application):  # type: ignore[no-untyped-def]
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=None)
        async with aiohttp.ClientSession(
            connector=connector, auto_decompress=False, timeout=aiohttp.ClientTimeout(total=None)
        ) as session:
            app[SESSION] = session
            yield

    app.cleanup_ctx.append(session_ctx)
    app.router.add_route("*", "/{tail:.*}", proxy)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--upstream", action="append", required=True, help="upstream base URL, repeatable")
    args = parser.parse_args()
    web.run_app(
        create_app(args.upstream),
        host=args.host,
        port=args.port,
        access_log=None,
        print=None,
        handler_cancellation=True,
    )


if __name__ == "__main__":
    main()
