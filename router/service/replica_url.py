"""A replica's base URL: the id it gets by default and the (host, port, base path) the upstream client connects to.

The settings check `replicas` with `split_url` when they load, and the pool, the admin API and discovery name and
split each replica's URL with these same two functions.
"""

from __future__ import annotations

from urllib.parse import urlsplit


def replica_id(url: str) -> str:
    """Default id of a replica: host:port, plus its path when it has one."""
    parts = urlsplit(url)
    path = parts.path.rstrip("/")
    return f"{parts.netloc}{path}"


def split_url(url: str) -> tuple[str, int, str]:
    """(host, port, base path) of a replica's http:// base URL; ValueError for anything else. Credentials in the URL
    are refused: the router would not send them, and the URL shows in headers, metrics and logs."""
    if not url.isascii() or not url.isprintable() or any(c.isspace() for c in url):
        raise ValueError("replica URL must be printable ASCII without spaces")
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"replica URL must be http://host[:port][/path], got {url!r}")
    if parts.username is not None or parts.password is not None:
        raise ValueError("replica URL must not carry credentials (user:password@): the router sends none")
    try:
        port = parts.port or 80
    except ValueError as exc:
        raise ValueError(f"replica URL has a bad port: {url!r}") from exc
    return parts.hostname, port, parts.path.rstrip("/")
