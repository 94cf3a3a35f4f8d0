"""The one place a Redis URL becomes a `redis.asyncio` client: standalone, Sentinel or Cluster.

redis-py's `from_url` builds standalone clients only, so the two other deployments get a URL form of their own:

- `redis://`, `rediss://`, `unix://`: `redis.asyncio.from_url` (standalone).
- `redis+sentinel://[[user]:password@]host:port[,host:port...]/SERVICE[/DB]`:
  `Sentinel(hosts).master_for(SERVICE, db=DB)`, which asks the sentinels for the primary and so follows a failover.
- `redis+cluster://[[user]:password@]host:port[,host:port...]`: `RedisCluster(startup_nodes=hosts)`.

`rediss+sentinel://` and `rediss+cluster://` speak TLS. The user and password authenticate at the primary (Sentinel)
or at every node (Cluster); sentinels are asked without them. Ports default to 26379 (sentinels) and 6379 (nodes).
`parse_redis_url` checks a URL without connecting (settings time); `redis_client` builds the client.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import unquote

import redis.asyncio as redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.sentinel import Sentinel

_STANDALONE_SCHEMES = ("redis", "rediss", "unix")
_DEFAULT_PORTS = {"sentinel": 26379, "cluster": 6379}


@dataclass(frozen=True)
class RedisTarget:
    """What a Redis URL names: `kind`, and for Sentinel and Cluster the parts redis-py takes one by one."""

    url: str
    kind: Literal["standalone", "sentinel", "cluster"]
    hosts: tuple[tuple[str, int], ...] = ()
    """Sentinels (sentinel) or startup nodes (cluster)."""
    service: str = ""
    """The primary's name as the sentinels know it (sentinel)."""
    db: int = 0
    username: str | None = None
    password: str | None = None
    is_tls: bool = False


def parse_redis_url(url: str) -> RedisTarget:
    """The URL's parts; ValueError naming what is wrong with it (the URL shown with its password masked)."""
    try:
        return _parse(url)
    except ValueError as exc:
        raise ValueError(str(exc).replace(repr(url), repr(_masked(url)))) from None


def _masked(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    netloc, slash, path = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    if not (sep and at and ":" in userinfo):
        return url
    return f"{scheme}://{userinfo.partition(':')[0]}:***@{hosts}{slash}{path}"


def _parse(url: str) -> RedisTarget:
    scheme, sep, rest = url.partition("://")
    scheme = scheme.lower()
    if not sep:
        raise ValueError(f"redis_url {url!r} has no scheme (redis://, rediss://, unix://, redis+sentinel://, ...)")
    if scheme in _STANDALONE_SCHEMES:
        return RedisTarget(url, "standalone")
    base, plus, kind = scheme.partition("+")
    if base not in ("redis", "rediss") or not plus or kind not in ("sentinel", "cluster"):
        raise ValueError(
            f"redis_url {url!r}: the scheme must be redis, rediss, unix, redis+sentinel, rediss+sentinel, "
            "redis+cluster or rediss+cluster"
        )
    if "?" in rest or "#" in rest:
        raise ValueError(f"redis_url {url!r}: {kind} URLs take no query or fragment")
    netloc, _, path = rest.partition("/")
    userinfo, at, hostlist = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon else None
    hosts = tuple(_host_port(url, part, _DEFAULT_PORTS[kind]) for part in hostlist.split(","))
    parts = [unquote(p) for p in path.split("/")] if path else []
    if kind == "cluster":
        if any(parts):
            raise ValueError(f"redis_url {url!r}: a cluster URL has no path (a cluster has database 0 only)")
        return RedisTarget(url, "cluster", hosts, username=username, password=password, is_tls=base == "rediss")
    if not parts or not parts[0]:
        raise ValueError(f"redis_url {url!r}: a sentinel URL names the primary's service: .../SERVICE[/DB]")
    if len(parts) > 2 and any(parts[2:]):
        raise ValueError(f"redis_url {url!r}: a sentinel URL's path is /SERVICE[/DB], got /{path}")
    db_text = parts[1] if len(parts) > 1 else ""
    if db_text and not db_text.isdigit():
        raise ValueError(f"redis_url {url!r}: the database must be a number, got {db_text!r}")
    return RedisTarget(
        url,
        "sentinel",
        hosts,
        service=parts[0],
        db=int(db_text or 0),
        username=username,
        password=password,
        is_tls=base == "rediss",
    )


def _host_port(url: str, part: str, default_port: int) -> tuple[str, int]:
    if part.startswith("["):  # [IPv6]:port
        host, bracket, port_text = part[1:].partition("]")
        if not bracket or (port_text and not port_text.startswith(":")):
            raise ValueError(f"redis_url {url!r}: bad host {part!r}")
        port_text = port_text[1:]
    else:
        host, _, port_text = part.partition(":")
    if not host:
        raise ValueError(f"redis_url {url!r}: a host is missing (host:port[,host:port...])")
    if not port_text:
        return host, default_port
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"redis_url {url!r}: bad port {port_text!r} of host {host!r}")
    return host, int(port_text)


def redis_client(url: str, stack: contextlib.AsyncExitStack, *, timeout_s: float, connect_timeout_s: float) -> Any:
    """A client for `url` whose commands time out after `timeout_s` (connecting: `connect_timeout_s`); what it
    holds is closed with `stack`. It connects lazily, at its first command."""
    target = parse_redis_url(url)
    client: Any
    if target.kind == "standalone":
        client = redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=connect_timeout_s)
    elif target.kind == "cluster":
        client = RedisCluster(
            startup_nodes=[ClusterNode(host, port) for host, port in target.hosts],
            username=target.username,
            password=target.password,
            ssl=target.is_tls,
            socket_timeout=timeout_s,
            socket_connect_timeout=connect_timeout_s,
        )
    else:
        timeouts: dict[str, Any] = {"socket_timeout": timeout_s, "socket_connect_timeout": connect_timeout_s}
        sentinel = Sentinel(list(target.hosts), sentinel_kwargs={**timeouts, "ssl": target.is_tls}, **timeouts)
        for sentinel_client in sentinel.sentinels:
            stack.push_async_callback(sentinel_client.aclose)
        client = sentinel.master_for(
            target.service,
            db=target.db,
            username=target.username,
            password=target.password,
            ssl=target.is_tls,
        )
    stack.push_async_callback(client.aclose)
    return client
