"""Consistent hashing: a ketama hash ring maps each request's key to a replica.

Each replica owns `virtual_nodes` points on a 32-bit ring: as in ketama (libketama, memcached clients), point
group i is the MD5 digest of "<replica id>-<i>", read as four little-endian uint32 points. A key hashes to
the first 4 bytes of its MD5 digest and belongs to the first replica point at or after it, wrapping around.
Adding a replica to N moves only the keys that land on its new points, about 1/(N+1) of them, all to it;
removing one moves only its own keys.

The key is the request's `session_key` when the client sent one, else its first block hash (so requests that
share a first block, such as a system prompt, land together), else a constant (prompts shorter than a block
all go to one replica). The ring is built over the eligible replicas passed in, and rebuilt only when that set
changes.

Parameters (`ConsistentHashConfig` below): virtual_nodes, default 160 (ketama's). Load-blind; the branch is
CONSISTENT_HASH (ONLY_REPLICA for a single replica). Source: Karger et al., "Consistent Hashing and Random
Trees" (STOC 1997); ketama's point layout; SGLang router's and vLLM router's `consistent_hash`.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Sequence
from typing import Literal

from pydantic import Field

from router.policy.decisions import decision
from router.policy.types import Branch, Decision, PolicyConfigModel, ReplicaState, RouteRequest


class ConsistentHashConfig(PolicyConfigModel):
    """A ketama hash ring over the session key or the first block hash (see `consistent_hash`)."""

    kind: Literal["consistent_hash"] = "consistent_hash"

    virtual_nodes: int = Field(default=160, ge=1)
    """Points on the ring per replica. 160 is ketama's (and vllm-router's) default: 40 MD5 digests of 4 points
    each, which keeps the load spread within a few percent."""


_POINTS_PER_DIGEST = 4
"""An MD5 digest is 16 bytes: four uint32 ring points (ketama)."""


def _digest(data: bytes) -> bytes:
    return hashlib.md5(data, usedforsecurity=False).digest()


def ring_points(replica_id: str, virtual_nodes: int) -> list[int]:
    """The ketama ring points of one replica."""
    points: list[int] = []
    for group in range(-(-virtual_nodes // _POINTS_PER_DIGEST)):
        digest = _digest(f"{replica_id}-{group}".encode())
        points.extend(int.from_bytes(digest[4 * k : 4 * k + 4], "little") for k in range(_POINTS_PER_DIGEST))
    return points[:virtual_nodes]


def key_point(key: bytes) -> int:
    """Where a key falls on the ring."""
    return int.from_bytes(_digest(key)[:4], "little")


def request_key(request: RouteRequest) -> bytes:
    """Session key, else first block hash, else a constant."""
    if request.session_key is not None:
        return b"s:" + request.session_key.encode()
    if request.hashes:
        return b"h:" + request.hashes[0].to_bytes(8, "little")
    return b""


class ConsistentHash:
    """A ketama ring over the eligible replicas."""

    name = "consistent_hash"

    def __init__(self, config: ConsistentHashConfig) -> None:
        self.config = config
        self._ring_ids: tuple[str, ...] = ()
        self._points: list[int] = []
        self._owners: list[str] = []

    def _ring(self, replicas: Sequence[ReplicaState]) -> tuple[list[int], list[str]]:
        ids = tuple(sorted(r.id for r in replicas))
        if ids != self._ring_ids:
            ring = sorted((p, rid) for rid in ids for p in ring_points(rid, self.config.virtual_nodes))
            self._ring_ids = ids
            self._points = [p for p, _ in ring]
            self._owners = [rid for _, rid in ring]
        return self._points, self._owners

    def select(self, request: RouteRequest, replicas: Sequence[ReplicaState], *, now: float) -> Decision:
        if len(replicas) == 1:
            return decision(request, replicas[0].id, Branch.ONLY_REPLICA)
        points, owners = self._ring(replicas)
        index = bisect.bisect_left(points, key_point(request_key(request))) % len(points)
        return decision(request, owners[index], Branch.CONSISTENT_HASH)
