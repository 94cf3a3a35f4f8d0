"""The hostile half of the soak (`bench_soak.py`): inputs the router must withstand, each kind bounded in rate, in
count and in time, all sent to 127.0.0.1.

Each kind in `attacks()` sends at most `per_minute` a minute, `at_once` at a time, each send within its
`deadline_s`, and starts none that could outlast the soak. A send is one request on a fresh connection, written
as raw bytes (aiohttp would refuse to write most of them), or a few writes into the fleet's Redis keys. Its outcome
is the status of the router's first answer, `closed` (the connection ended without an answer), `reset`, or
`silent` (no answer by the deadline); Redis writes are `written` or `refused` (by Redis). An outcome is bad when
the router made a 5xx of its own (501 and 505 refuse what HTTP/1.1 lets a server refuse; a 5xx carrying
`x-shoal-replica` is the replica's) or stayed silent. The inputs follow tests/integration's hostile, fuzz and
fleet-fuzz tests.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from router.policy.sharing import Batch, Drain, Load, Pin, Routed, encode_batch

MODEL = "shoal-demo"
ROUTER_OWN_5XX_ALLOWED = frozenset({501, 505})
SESSION_HEADER = "x-session-id"


@dataclass(frozen=True)
class Outcome:
    variant: str
    result: str
    """The first answer's status, or closed / reset / silent / written / refused."""
    is_bad: bool
    seconds: float


@dataclass
class Tally:
    """Outcomes of one kind over the soak."""

    sent: int = 0
    results: collections.Counter[str] = field(default_factory=collections.Counter)
    by_variant: collections.Counter[str] = field(default_factory=collections.Counter)
    """`variant: result`, counted."""
    bad: collections.Counter[str] = field(default_factory=collections.Counter)
    """`variant: result` of bad outcomes, counted."""
    max_answer_s: float = 0.0
    events: list[tuple[float, float, str, str]] = field(default_factory=list)
    """(started, on time.monotonic(); seconds; variant; result) of every send."""

    def as_json(self) -> dict[str, object]:
        return {
            "sent": self.sent,
            "results": dict(self.results),
            "by_variant": dict(self.by_variant),
            "bad": dict(self.bad),
            "max_answer_s": self.max_answer_s,
            "events": self.events,
        }


@dataclass(frozen=True)
class Attack:
    name: str
    per_minute: float
    at_once: int
    deadline_s: float
    send: Callable[[random.Random], Awaitable[Outcome]]


def _post(path: str, body: bytes, extra: bytes = b"", host: bytes = b"Host: r\r\n") -> bytes:
    return b"POST %b HTTP/1.1\r\n%bContent-Type: application/json\r\nContent-Length: %d\r\n%b\r\n%b" % (
        path.encode(),
        host,
        len(body),
        extra,
        body,
    )


def _completion(text: str, max_tokens: int = 2) -> bytes:
    return json.dumps({"model": MODEL, "prompt": text, "max_tokens": max_tokens}).encode()


CHUNKED_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"


def _chunked_variants() -> dict[str, tuple[bytes, bool]]:
    """name -> (bytes, half-close after them: the request is incomplete, so EOF is the client's last word)."""
    te = CHUNKED_HEAD + b"Transfer-Encoding: chunked\r\n\r\n"
    body = _completion("chunked " + " " * 2000)
    one_byte_chunks = b"".join(b"1\r\n%b\r\n" % body[i : i + 1] for i in range(len(body))) + b"0\r\n\r\n"
    return {
        "size not hex": (te + b"zz\r\nabc\r\n0\r\n\r\n", False),
        "size overflows": (te + b"ffffffffffffffffffffffff\r\n{}\r\n0\r\n\r\n", False),
        "size negative": (te + b"-1\r\n{}\r\n0\r\n\r\n", False),
        "size 0x-prefixed": (te + b"0x2\r\n{}\r\n0\r\n\r\n", False),
        "extension of 100 KB": (te + b"2;" + b"e" * 100_000 + b"\r\n{}\r\n0\r\n\r\n", False),
        "no CRLF after data": (te + b"2\r\n{}X0\r\n\r\n", False),
        "content-length and chunked": (
            CHUNKED_HEAD + b"Content-Length: 6\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\nG"
            b"GET /admin/replicas HTTP/1.1\r\nHost: r\r\n\r\n",
            False,
        ),
        "chunked, identity": (CHUNKED_HEAD + b"Transfer-Encoding: chunked, identity\r\n\r\n0\r\n\r\n", False),
        "xchunked": (CHUNKED_HEAD + b"Transfer-Encoding: xchunked\r\n\r\n0\r\n\r\n", False),
        "chunked twice": (
            CHUNKED_HEAD + b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
            False,
        ),
        "space before colon": (CHUNKED_HEAD + b"Transfer-Encoding : chunked\r\n\r\n0\r\n\r\n", False),
        "2 GB chunk, then EOF": (te + b"7fffffff\r\n" + b"x" * 4096, True),
        "unfinished body, then EOF": (te + b'40\r\n{"model"', True),
        "2,000 chunks of 1 byte": (
            te.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n", 1) + one_byte_chunks,
            False,
        ),
    }


def _deep(kind: str, depth: int) -> bytes:
    if kind == "list":
        return b'{"model":"shoal-demo","prompt":' + b"[" * depth + b"1" + b"]" * depth + b"}"
    if kind == "object":
        return b'{"model":"shoal-demo","prompt":"x","user":' + b'{"a":' * depth + b"1" + b"}" * depth + b"}"
    tools = b"[" * depth + b'"x"' + b"]" * depth
    return b'{"model":"shoal-demo","messages":[{"role":"user","content":"hi"}],"tools":' + tools + b"}"


def _invalid_json_variants() -> dict[str, tuple[str, bytes]]:
    """name -> (path, body)."""
    c, chat = "/v1/completions", "/v1/chat/completions"
    return {
        "truncated": (c, b'{"model": "shoal-demo", "prompt": '),
        "random bytes": (c, bytes(range(256)) * 2),
        "a list": (c, b"[]"),
        "null": (c, b"null"),
        "a huge float": (c, b"1e999999"),
        "lists 100k deep": (c, _deep("list", 100_000)),
        "objects 50k deep": (c, _deep("object", 50_000)),
        "chat tools 1k deep": (chat, _deep("tools", 1_000)),
        "max_tokens of 10k digits": (c, b'{"model":"shoal-demo","prompt":"x","max_tokens":' + b"9" * 10_000 + b"}"),
        "NaN": (c, b'{"model":"shoal-demo","prompt":"x","max_tokens":NaN}'),
        "lone surrogate": (c, b'{"model":"shoal-demo","prompt":"\\ud800"}'),
        "UTF-16": (c, '{"model":"shoal-demo","prompt":"x"}'.encode("utf-16")),
        "messages a string": (chat, b'{"model":"shoal-demo","messages":"hi"}'),
        "role a number": (chat, b'{"model":"shoal-demo","messages":[{"role":1,"content":"hi"}]}'),
        "duplicate keys": (c, b'{"model":"shoal-demo","model":"other","prompt":"x","prompt":[1,2]}'),
        "model of 1 MB": (c, json.dumps({"model": "m" * (1 << 20), "prompt": "x"}).encode()),
    }


def _head_variants() -> dict[str, bytes]:
    return {
        "one 1 MiB header": b"GET /v1/models HTTP/1.1\r\nHost: r\r\nX-Pad: " + b"a" * (1 << 20) + b"\r\n\r\n",
        "20,000 headers": b"GET /v1/models HTTP/1.1\r\nHost: r\r\n" + b"X-A: b\r\n" * 20_000 + b"\r\n",
        "a 1 MiB path": b"GET /v1/" + b"m" * (1 << 20) + b" HTTP/1.1\r\nHost: r\r\n\r\n",
        "a 1 MiB content-length": b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: "
        + b"7" * (1 << 20)
        + b"\r\n\r\n",
    }


def _trailer_variants() -> dict[str, bytes]:
    body = _completion("trailer")
    head = CHUNKED_HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + b"%x\r\n%b\r\n0\r\n" % (len(body), body)
    return {
        "one 2 MiB trailer": head + b"X-Pad: " + b"a" * (2 << 20) + b"\r\n\r\n",
        "20,000 trailers": head + b"X-T: v\r\n" * 20_000 + b"\r\n",
    }


def _no_host_variants() -> dict[str, bytes]:
    body = _completion("no host")
    return {
        "HTTP/1.1, no Host": _post("/v1/completions", body, host=b""),
        "HTTP/1.0, no Host": b"GET /v1/models HTTP/1.0\r\n\r\n",
        "two Hosts": _post("/v1/completions", body, host=b"Host: a\r\nHost: b\r\n"),
        "empty Host": _post("/v1/completions", body, host=b"Host: \r\n"),
        "Host not UTF-8": _post("/v1/completions", body, host=b"Host: \xff\xfe\xc3\x28\r\n"),
        "absolute URI, no Host": b"GET http://router/v1/models HTTP/1.1\r\n\r\n",
    }


def _session_variants() -> dict[str, bytes]:
    body = json.dumps({"model": MODEL, "prompt": "session " * 30, "max_tokens": 2}).encode()
    name = SESSION_HEADER.encode()
    return {
        "not UTF-8": _post("/v1/completions", body, b"%b: \xff\xfe\xfd\r\n" % name),
        "broken UTF-8 sequence": _post("/v1/completions", body, b"%b: user-\xc3\x28\xa0\r\n" % name),
        "Latin-1 letters": _post("/v1/completions", body, b"%b: caf\xe9\r\n" % name),
        "8 KB": _post("/v1/completions", body, b"%b: %b\r\n" % (name, b"s" * 8192)),
        "control bytes": _post("/v1/completions", body, b"%b: a\x01\x02\x7fb\r\n" % name),
        "twice": _post("/v1/completions", body, b"%b: a\r\n%b: b\r\n" % (name, name)),
    }


def _admin_variants() -> dict[str, bytes]:
    replicas = b'{"url": "http://127.0.0.1:1", "name": "intruder"}'
    return {
        "no token, add": _post("/admin/replicas", replicas),
        "no token, list": b"GET /admin/replicas HTTP/1.1\r\nHost: r\r\n\r\n",
        "wrong token, drain": _post("/admin/replicas/x/drain", b"", b"Authorization: Bearer wrong\r\n"),
        "token not UTF-8": b"GET /admin/index HTTP/1.1\r\nHost: r\r\nAuthorization: Bearer \xff\xfe\r\n\r\n",
        "token of 64 KB": b"DELETE /admin/replicas/x HTTP/1.1\r\nHost: r\r\nAuthorization: Bearer "
        + b"t" * 65_536
        + b"\r\n\r\n",
        "basic auth, garbage body": _post("/admin/replicas", bytes(range(256)), b"Authorization: Basic Og==\r\n"),
        "no token, undrain": _post("/admin/replicas/%2e%2e%2f/undrain", b"{}"),
    }


async def exchange(port: int, data: bytes, deadline_s: float, *, half_close: bool = False) -> tuple[str, bool]:
    """Write `data` on a fresh connection and read the first answer's head: (outcome, is_bad)."""
    try:
        async with asyncio.timeout(deadline_s):
            reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 20)
            try:
                with contextlib.suppress(ConnectionError):
                    writer.write(data)
                    if half_close:
                        writer.write_eof()
                    await writer.drain()  # the router may close before it has read all: its answer is still read
                return await _judged(reader.readuntil(b"\r\n\r\n"))
            finally:
                writer.close()
    except TimeoutError:
        return "silent", True
    except OSError:
        return "reset", False


async def _judged(head: Awaitable[bytes]) -> tuple[str, bool]:
    """The outcome of an answer's head once read: its status, or how the connection ended without one."""
    try:
        return _judge(await head)
    except asyncio.IncompleteReadError as exc:
        return _judge(exc.partial) if exc.partial else ("closed", False)
    except ConnectionError:
        return "reset", False


def _judge(head: bytes) -> tuple[str, bool]:
    lines = head.split(b"\r\n")
    try:
        status = int(lines[0].split()[1])
    except (IndexError, ValueError):
        return "unparsable answer", True
    from_replica = any(line.lower().startswith(b"x-shoal-replica:") for line in lines[1:])
    if status >= 500 and from_replica:
        return f"{status} (replica)", False
    return str(status), status >= 500 and status not in ROUTER_OWN_5XX_ALLOWED


async def slow_head(port: int, pace_s: float, deadline_s: float) -> tuple[str, bool]:
    """A head sent one byte every `pace_s`, never finished: the router should answer 408 at its header timeout."""
    data = b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\nX-Slow: " + b"s" * 4096
    try:
        async with asyncio.timeout(deadline_s):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            answer = asyncio.ensure_future(reader.readuntil(b"\r\n\r\n"))
            try:
                for i in range(len(data)):
                    if answer.done():
                        break
                    writer.write(data[i : i + 1])
                    with contextlib.suppress(TimeoutError, asyncio.IncompleteReadError, ConnectionError):
                        await asyncio.wait_for(asyncio.shield(answer), pace_s)  # the pace of a slow client
                return await _judged(answer)
            finally:
                answer.cancel()
                writer.close()
    except TimeoutError:
        return "silent", True
    except OSError:
        return "reset", False


class RedisGarbage:
    """Writes into the fleet's keys what no router would: random fields and bytes, batches of random records,
    extreme stream IDs, random drains fields, and the keys replaced by values of another type (deleted again
    `wrong_type_hold_s` later, as an operator would) or deleted."""

    def __init__(self, url: str, namespace: str, replica_ids: list[str], wrong_type_hold_s: float = 2.0) -> None:
        self.client = aioredis.Redis.from_url(url, socket_timeout=5)
        self.stream_key = f"{{{namespace}}}:fleet:records"
        self.drains_key = f"{{{namespace}}}:fleet:drains"
        self.replica_ids = replica_ids
        self.wrong_type_hold_s = wrong_type_hold_s

    async def close(self) -> None:
        await self.client.aclose()

    def _batch(self, rng: random.Random) -> bytes:
        names = [*self.replica_ids, "ghost", "\u0000\uffff", "r" * 200]
        count = rng.choice([0, 3, 2**31, 2**63])
        return encode_batch(
            Batch(
                router=rng.choice(["peer", "", "p" * 100]),
                seq=rng.choice([1, 2, 2**63]),
                routed=tuple(
                    Routed(rng.choice(names), tuple(rng.getrandbits(64) for _ in range(4)), rng.random() < 0.5)
                    for _ in range(rng.randrange(4))
                ),
                # Loads on unknown replicas only: a huge load on a real one would rightly steer traffic away.
                loads={rng.choice(names[len(self.replica_ids) :]): Load(count, count, count)},
                is_complete=rng.random() < 0.5,
                pins=(Pin("s" * rng.randrange(1, 64), rng.choice(names)),),
                # Undrains of the real replicas, drains of unknown ones: a drain of a real one would stop it.
                drains=(Drain(rng.choice(self.replica_ids), False), Drain("ghost", True)),
            )
        )

    async def send(self, rng: random.Random) -> Outcome:
        started = time.monotonic()
        variant = rng.choice(
            ["random fields", "random bytes", "random batch", "mutated batch", "extreme ID", "future ID"] * 4
            + ["drains field", "wrong type", "delete"]
        )
        try:
            await self._write(variant, rng)
            result = "written"
        except RedisError:
            result = "refused"  # an ID Redis refuses (not above the top one): nothing was written
        return Outcome(variant, result, False, time.monotonic() - started)

    async def _write(self, variant: str, rng: random.Random) -> None:
        key = self.stream_key
        if variant == "random fields":
            fields = {rng.randbytes(rng.randrange(1, 5)): rng.randbytes(rng.randrange(17)) for _ in range(3)}
            await self.client.xadd(key, fields)  # type: ignore[arg-type]
        elif variant == "random bytes":
            await self.client.xadd(key, {b"r": b"peer", b"d": rng.randbytes(rng.randrange(64))})
        elif variant == "random batch":
            await self.client.xadd(key, {b"r": b"peer", b"d": self._batch(rng)})
        elif variant == "mutated batch":
            data = self._batch(rng)
            at = rng.randrange(len(data))
            await self.client.xadd(key, {b"r": b"peer", b"d": data[:at] + rng.randbytes(3) + data[at + 1 :]})
        elif variant == "extreme ID":
            top = rng.choice(["18446744073709551615-18446744073709551615", "18446744073709551615-0"])
            await self.client.xadd(key, {b"r": b"peer", b"d": self._batch(rng)}, id=top)
        elif variant == "future ID":
            await self.client.xadd(key, {b"r": b"peer", b"d": self._batch(rng)}, id=f"{rng.getrandbits(50)}-0")
        elif variant == "drains field":
            await self.client.hset(self.drains_key, rng.randbytes(rng.randrange(1, 9)), rng.randbytes(4))
        elif variant == "delete":
            await self.client.delete(rng.choice([key, self.drains_key]))
        else:
            target = rng.choice([key, self.drains_key])
            await self.client.delete(target)
            kind = rng.choice(["string", "list", "set", "zset", "hash"])
            if kind == "string":
                await self.client.set(target, b"x")
            elif kind == "list":
                await self.client.rpush(target, b"x")
            elif kind == "set":
                await self.client.sadd(target, b"x")
            elif kind == "zset":
                await self.client.zadd(target, {b"x": 1.0})
            elif target == key:
                await self.client.hset(target, b"x", b"1")
            else:
                await self.client.set(target, b"x")
            await asyncio.sleep(self.wrong_type_hold_s)  # how long the wrong type stays before the operator's fix
            await self.client.delete(target)


def _raw_attack(
    name: str, port: int, per_minute: float, at_once: int, deadline_s: float, variants: dict[str, bytes]
) -> Attack:
    names = sorted(variants)

    async def send(rng: random.Random) -> Outcome:
        variant = rng.choice(names)
        started = time.monotonic()
        result, is_bad = await exchange(port, variants[variant], deadline_s)
        return Outcome(variant, result, is_bad, time.monotonic() - started)

    return Attack(name, per_minute, at_once, deadline_s, send)


def attacks(port: int, redis_garbage: RedisGarbage, header_timeout_s: float, scale: float = 1.0) -> list[Attack]:
    """The soak's hostile kinds against the router on `port`; `scale` multiplies every rate."""
    chunked = _chunked_variants()
    json_bodies = {name: _post(path, body) for name, (path, body) in _invalid_json_variants().items()}
    ids = random.Random(0).choices(range(150_000), k=500_000)  # some 3.4 MB of JSON
    tail = (", ".join(map(str, ids)) + "]").encode()

    async def send_chunked(rng: random.Random) -> Outcome:
        variant = rng.choice(sorted(chunked))
        data, half_close = chunked[variant]
        started = time.monotonic()
        result, is_bad = await exchange(port, data, 10.0, half_close=half_close)
        return Outcome(variant, result, is_bad, time.monotonic() - started)

    async def send_token_ids(rng: random.Random) -> Outcome:
        # A new first block each time, so every one is hashed and routed afresh.
        head = (
            b'{"model":"shoal-demo","max_tokens":1,"prompt":['
            + ", ".join(str(rng.randrange(150_000)) for _ in range(16)).encode()
        )
        started = time.monotonic()
        result, is_bad = await exchange(port, _post("/v1/completions", head + b", " + tail + b"}"), 30.0)
        return Outcome("500,016 token ids", result, is_bad, time.monotonic() - started)

    slow_deadline_s = header_timeout_s + 15.0

    async def send_slow(rng: random.Random) -> Outcome:
        started = time.monotonic()
        result, is_bad = await slow_head(port, 0.5 + rng.random(), slow_deadline_s)
        return Outcome("head at 1 byte per 0.5-1.5 s", result, is_bad, time.monotonic() - started)

    return [
        _raw_attack("oversized head", port, 20 * scale, 2, 10.0, _head_variants()),
        _raw_attack("oversized trailer", port, 10 * scale, 2, 10.0, _trailer_variants()),
        Attack("chunked framing", 60 * scale, 4, 10.0, send_chunked),
        Attack("slow head", 30 * scale, 16, slow_deadline_s, send_slow),
        _raw_attack("invalid JSON, deep nesting", port, 60 * scale, 4, 10.0, json_bodies),
        Attack("huge token-id prompt", 4 * scale, 1, 30.0, send_token_ids),
        _raw_attack("session header", port, 60 * scale, 4, 10.0, _session_variants()),
        _raw_attack("no or odd Host", port, 30 * scale, 2, 10.0, _no_host_variants()),
        _raw_attack("admin without token", port, 60 * scale, 4, 10.0, _admin_variants()),
        Attack("Redis records", 60 * scale, 1, 10.0, redis_garbage.send),
    ]


async def run_attacks(attack_list: list[Attack], until: float, seed: int) -> dict[str, Tally]:
    """Every kind at its rate until `until` (time.monotonic()); none started that could end after it."""
    tallies = {a.name: Tally() for a in attack_list}

    async def one(attack: Attack, rng: random.Random, slots: asyncio.Semaphore) -> None:
        started = time.monotonic()
        try:
            outcome = await attack.send(rng)
        except Exception as exc:  # the client's own trouble, counted, never the soak's end
            outcome = Outcome("?", f"client error: {type(exc).__name__}", False, time.monotonic() - started)
        finally:
            slots.release()
        tally = tallies[attack.name]
        tally.results[outcome.result] += 1
        tally.by_variant[f"{outcome.variant}: {outcome.result}"] += 1
        tally.events.append((started, outcome.seconds, outcome.variant, outcome.result))
        tally.max_answer_s = max(tally.max_answer_s, outcome.seconds)
        if outcome.is_bad:
            tally.bad[f"{outcome.variant}: {outcome.result}"] += 1

    async def kind(attack: Attack, rng: random.Random) -> None:
        slots = asyncio.Semaphore(attack.at_once)
        interval_s = 60.0 / attack.per_minute
        running: set[asyncio.Task[None]] = set()
        next_at = time.monotonic() + rng.random() * interval_s
        while next_at + attack.deadline_s < until:
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))  # the kind's schedule
            await slots.acquire()  # at most `at_once` of the kind at a time
            now = time.monotonic()
            if now + attack.deadline_s >= until:
                slots.release()
                break
            next_at = max(next_at, now) + interval_s  # a kind that waited for a slot does not catch up in a burst
            tallies[attack.name].sent += 1
            task = asyncio.create_task(one(attack, rng, slots))
            running.add(task)
            task.add_done_callback(running.discard)
        await asyncio.gather(*running)

    await asyncio.gather(*(kind(a, random.Random(f"{seed}-{a.name}")) for a in attack_list))
    return tallies
