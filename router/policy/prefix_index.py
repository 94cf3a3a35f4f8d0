"""Prefix index: which replica holds which prompt-prefix blocks (DESIGN.md, Router).

Shape. Block hashes are chained (`hashing`): a hash names its whole prefix, so the index needs no tree and no
parent links. It is one dict `block hash -> _Node`. A node holds the replicas holding the block as an int bitmask
over per-index replica slots (a replica's single-bit mask is one shared int object, so a block held by one replica
costs no mask of its own; a Python set would cost 200+ bytes a block), and `expiry_s`, a lower bound on the
earliest deadline among its holders' expiring entries (inf when there are none). A node whose `expiry_s` has
passed is checked holder by holder, and its bound refreshed, so an expired entry never counts, swept or not;
any other node costs one float comparison.

Match. A replica is prefix-closed while holding a block implies holding all of its ancestors. Records, eviction
and sweeps keep it so (below); only an engine `removed`, which may name an inner block, breaks it, until the
replica holds nothing again. Over prefix-closed replicas the live holders of hashes[j] only shrink as j grows,
so `match` binary-searches the few depths where they shrink: O(log blocks) look-ups per distinct holder set,
some 30 for a 512-block prompt. Other replicas are matched by walking the hashes once, AND-ing masks until no
bit is left: O(blocks) look-ups whatever the number of replicas.

Entries. A (block, replica) pair is one of:
  - exact: the engine said so in a `stored` event. It leaves on `removed` or `cleared`, never by TTL or capacity.
  - approximate: the router sent a request with this prefix there (`record`). It expires `ttl_s` after its last
    touch.
  - predicted: `record(predicted=True)`, for sibling requests that arrive before the engine's `stored`. It
    expires `predicted_ttl_s` after its last touch unless a `stored` makes it exact first.
Approximate and predicted entries are the index's guesses. A replica keeps them in one insertion-ordered dict
node -> deadline (seconds), oldest touch first; a touch moves an entry to the end and keeps the later of its old
and new deadlines. `record` takes a prompt's hashes from block 0 and touches them leaf first, so a block is
always more recent than its descendants and expires no earlier than they do: evicting from the front, or
sweeping expired entries from the front, removes leaves before the blocks they hang from, and never orphans a
descendant. `capacity_blocks` bounds a replica's guesses; past it, the front is evicted in one batch down to
(1 - evict_fraction) x capacity. Exact entries do not count against it: the engine's own eviction bounds them,
and it tells us.

Exact mode. A `stored` event's blocks are re-hashed with the router's hash from the event's token ids, chained
from the router hash of the event's parent, found through a per-replica map engine hash -> node; the engine hash
is kept only to apply a later `removed`. An event whose parent is unknown (its `stored` was missed, or the
block was removed since) is skipped and counted: chaining from the wrong parent would index the blocks under
hashes no request carries.

What commutes. A `stored` and a `record` of the same blocks leave the same index, hence the same match at every
later `now`, in either order: a record never downgrades an exact entry, and a `stored` upgrades whatever guess
it finds. Records commute with each other as far as match goes while no capacity eviction intervenes (an entry's
deadline is the latest any record gave it; the order of touches decides only what eviction takes first).
`removed` and `cleared` are the engine's latest word and must be applied in arrival order.

Time. Callers pass `now` in seconds and never let it go backwards; the index keeps no clock. `expire(now)`
sweeps expired guesses from the front of each replica's touch order, so a sweep costs about what it removes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import islice

from pydantic import BaseModel, ConfigDict, Field

from router.policy import hashing
from router.policy.kv_events import BlockRemoved, BlockStored, KVEvent

_NEVER = math.inf
_MAX_CACHED_MASKS = 4096


class PrefixIndexConfig(BaseModel):
    """Capacity and lifetimes of the prefix index's guessed entries."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    capacity_blocks: int = Field(default=200_000, ge=1)
    """Default per-replica bound, in blocks, on the index's guesses (approximate and predicted entries), used
    when `add_replica` is not given the replica's own. It sits above one GPU's KV cache for common models (an
    80 GB GPU holds some 20-60k 16-token blocks of a 7-8B model's KV), so that a replica of unknown size is not
    forgotten before its engine forgets; `ttl_s` is the bound that bites in approximate mode. Exact entries do
    not count against it."""

    ttl_s: float = Field(default=600.0, gt=0.0)
    """Seconds after its last touch at which an approximate entry expires. Ten minutes spans a conversation's
    turn-to-turn think time, so follow-ups still find their replica, while a prefix nobody has sent for that
    long has usually been evicted by a busy engine's LRU and should stop attracting requests."""

    predicted_ttl_s: float = Field(default=2.0, gt=0.0)
    """Seconds after its last touch at which a predicted entry expires. About a long prompt's prefill plus the
    event pipeline's delay: a sibling request arriving within it follows the first to its replica; after it the
    engine's `stored` event should have replaced the guess, and a missing one means the blocks never got cached
    (the request was cancelled or failed)."""

    evict_fraction: float = Field(default=0.05, ge=0.0, lt=1.0)
    """Fraction of capacity freed at once when a replica's guesses exceed it: eviction runs down to
    (1 - evict_fraction) x capacity, so it happens once per 5% of capacity (10k blocks at the default) rather
    than on every record, and the index under-predicts by at most that."""


@dataclass(frozen=True, slots=True)
class IndexStats:
    """A snapshot of the index's size and counters."""

    num_blocks: int
    """Distinct block hashes indexed."""
    num_entries: int
    """(block, replica) pairs: exact entries and unswept guesses."""
    blocks_per_replica: dict[str, int]
    """Entries per replica id (exact and guessed)."""
    events_applied: int
    """KV events applied."""
    events_skipped: int
    """KV events skipped: a `stored` whose parent the index does not know, or whose tokens do not fill its
    blocks."""
    evictions: int
    """Guesses evicted for capacity (TTL expiry not included)."""


class _Node:
    """One indexed block."""

    __slots__ = ("expiry_s", "hash", "holders")

    def __init__(self, block_hash: int, holders: int, expiry_s: float) -> None:
        self.hash = block_hash
        self.holders = holders
        """Bitmask of the replica slots holding the block; a single bit is always the replica's own `bit` object."""
        self.expiry_s = expiry_s
        """At most the earliest deadline among the holders' guesses for this block; inf when there are none."""


class _Replica:
    """One replica's entries."""

    __slots__ = (
        "bit",
        "capacity_blocks",
        "engine_blocks",
        "extra_engine_refs",
        "guesses",
        "id",
        "is_prefix_closed",
        "num_exact",
    )

    def __init__(self, replica_id: str, bit: int, capacity_blocks: int) -> None:
        self.id = replica_id
        self.bit = bit
        self.capacity_blocks = capacity_blocks
        self.guesses: dict[_Node, float] = {}
        """Approximate and predicted entries -> deadline in seconds, oldest touch first."""
        self.engine_blocks: dict[int, _Node] = {}
        """Engine hash -> node of each exact entry (the values are exactly the replica's exact entries)."""
        self.extra_engine_refs: dict[_Node, int] = {}
        """Exact nodes named by more than one engine hash (say, the same tokens under two cache salts): the
        number of engine hashes beyond the first, so that the entry leaves with the last of them."""
        self.num_exact = 0
        self.is_prefix_closed = True
        """Whether holding a block implies holding all its ancestors. Records touch whole prefixes, eviction
        takes leaves first and a sweep takes descendants no later than ancestors, so only an engine `removed`
        (which may name an inner block) can break it; it holds again once the replica holds nothing."""


class PrefixIndex:
    """Per-replica prefix-block index: exact from KV events, approximate from routing decisions.

    Pure: no I/O, no clock (callers pass `now`), no locks; the router and the simulator drive the same object.
    """

    def __init__(self, config: PrefixIndexConfig | None = None) -> None:
        self.config = config if config is not None else PrefixIndexConfig()
        self._nodes: dict[int, _Node] = {}
        self._replicas: dict[str, _Replica] = {}
        self._by_bit: dict[int, _Replica] = {}
        self._all_bits = 0
        self._closed_bits = 0  # bits of the replicas whose `is_prefix_closed` holds
        self._ids_by_bits: dict[int, tuple[str, ...]] = {}  # cache for turning masks into replica ids
        self._events_applied = 0
        self._events_skipped = 0
        self._evictions = 0

    # Replicas -------------------------------------------------------------------------------------------------

    @property
    def replicas(self) -> tuple[str, ...]:
        """Indexed replica ids, in the order they were added."""
        return tuple(self._replicas)

    def add_replica(self, replica: str, capacity_blocks: int | None = None) -> None:
        """Index a replica; for one already indexed, set its capacity (evicting down to it now if it shrank)."""
        capacity = self.config.capacity_blocks if capacity_blocks is None else capacity_blocks
        if capacity < 1:
            raise ValueError(f"capacity_blocks must be positive, got {capacity}")
        rep = self._replicas.get(replica)
        if rep is not None:
            rep.capacity_blocks = capacity
            if len(rep.guesses) > capacity:
                self._evict(rep)
            return
        slot = 0
        while self._all_bits >> slot & 1:
            slot += 1
        rep = _Replica(replica, 1 << slot, capacity)
        self._replicas[replica] = rep
        self._by_bit[rep.bit] = rep
        self._all_bits |= rep.bit
        self._closed_bits |= rep.bit
        self._ids_by_bits.clear()

    def remove_replica(self, replica: str) -> None:
        """Forget a replica and every entry it holds. Removing an unknown replica does nothing."""
        rep = self._replicas.pop(replica, None)
        if rep is None:
            return
        self._clear(rep)
        del self._by_bit[rep.bit]
        self._all_bits ^= rep.bit
        self._closed_bits &= ~rep.bit
        self._ids_by_bits.clear()

    # Queries --------------------------------------------------------------------------------------------------

    def match(self, hashes: Sequence[int], *, now: float) -> dict[str, int]:
        """Blocks of `hashes` each replica holds, contiguous from block 0; replicas with none are left out.

        `hashes` must be chained (`hashing`): the search relies on a hash naming its whole prefix. Expired
        guesses do not count, swept or not. Never changes what the index holds.
        """
        alive = self._all_bits
        if not alive or not hashes:
            return {}
        dropped: list[tuple[int, int]] = []  # (depth, bits of the replicas whose match is exactly `depth`)
        closed = alive & self._closed_bits
        if closed:
            self._search_closed(hashes, closed, now, dropped)
        if closed != alive:
            self._walk(hashes, alive ^ closed, now, dropped)
        out: dict[str, int] = {}
        for depth, bits in dropped:
            out.update(dict.fromkeys(self._ids_in(bits), depth))
        return out

    def _search_closed(self, hashes: Sequence[int], bits: int, now: float, dropped: list[tuple[int, int]]) -> None:
        """Match for prefix-closed replicas: binary searches for the depths where the holder set shrinks.

        A prefix-closed replica that holds block j holds blocks 0..j-1, and its live entries are prefix-closed
        too, so the live holders of hashes[j] shrink as j grows: each distinct holder set is one run of
        consecutive blocks, found in O(log blocks) look-ups.
        """
        get = self._nodes.get

        def holders(j: int) -> int:
            node = get(hashes[j])
            if node is None:
                return 0
            return node.holders if node.expiry_s > now else self._live_holders(node, now)

        num_blocks = len(hashes)
        held = holders(0) & bits
        lo = 0
        while held:
            # Invariant: every replica in `held` holds blocks 0..lo; find the last block they all hold.
            hi = num_blocks
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if holders(mid) & held == held:
                    lo = mid
                else:
                    hi = mid
            depth = lo + 1
            rest = holders(depth) & held if depth < num_blocks else 0
            dropped.append((depth, held ^ rest))
            held = rest
            lo = depth

    def _walk(self, hashes: Sequence[int], alive: int, now: float, dropped: list[tuple[int, int]]) -> None:
        """Match for any replicas: one look-up per block, AND-ing holder masks until none is left."""
        get = self._nodes.get
        depth = 0
        for block_hash in hashes:
            node = get(block_hash)
            if node is None:
                break
            held = node.holders if node.expiry_s > now else self._live_holders(node, now)
            if held is not alive and held != alive:
                kept = held & alive
                if kept != alive:
                    if depth:
                        dropped.append((depth, alive ^ kept))
                    if not kept:
                        return
                    # Reuse the node's own mask object when it is the new set, so that the next nodes, which
                    # usually share it, pass the identity test above.
                    alive = held if kept == held else kept
            depth += 1
        if depth:
            dropped.append((depth, alive))

    def stats(self) -> IndexStats:
        per_replica = {rep.id: len(rep.guesses) + rep.num_exact for rep in self._replicas.values()}
        return IndexStats(
            num_blocks=len(self._nodes),
            num_entries=sum(per_replica.values()),
            blocks_per_replica=per_replica,
            events_applied=self._events_applied,
            events_skipped=self._events_skipped,
            evictions=self._evictions,
        )

    # Approximate mode -----------------------------------------------------------------------------------------

    def record(self, replica: str, hashes: Sequence[int], *, now: float, predicted: bool = False) -> None:
        """The router sent a prompt with these block hashes (from block 0) to `replica`: guess it holds them all.

        New entries expire `ttl_s` (or `predicted_ttl_s` when `predicted`) after `now`; entries already guessed
        keep the later of their deadline and that one; exact entries are left as they are. Enforces the
        replica's capacity. Raises KeyError for a replica that is not indexed.
        """
        rep = self._replicas[replica]
        bit = rep.bit
        guesses = rep.guesses
        nodes = self._nodes
        deadline = now + (self.config.predicted_ttl_s if predicted else self.config.ttl_s)
        # Leaf first: each block ends up more recent than all of its descendants (eviction takes leaves first).
        for block_hash in reversed(hashes):
            node = nodes.get(block_hash)
            if node is None:
                node = nodes[block_hash] = _Node(block_hash, bit, deadline)
                guesses[node] = deadline
                continue
            old = guesses.pop(node, None)
            if old is not None:
                new = old if old > deadline else deadline
                guesses[node] = new
                if node.holders is bit:
                    node.expiry_s = new
            elif node.holders & bit:
                continue  # exact: the engine's word outranks a guess
            else:
                node.holders |= bit
                guesses[node] = deadline
                if deadline < node.expiry_s:
                    node.expiry_s = deadline
        if len(guesses) > rep.capacity_blocks:
            self._evict(rep)

    def expire(self, now: float) -> int:
        """Sweep guesses whose deadline has passed; returns the number of entries removed.

        Each replica's guesses are swept from the front of its touch order up to the first live one. A replica
        given both approximate and predicted records can hold an expired predicted entry behind a live
        approximate one: it never counts in `match`, and goes when it reaches the front or is evicted.
        """
        removed = 0
        for rep in self._replicas.values():
            expired: list[_Node] = []
            for node, deadline in rep.guesses.items():
                if deadline > now:
                    break
                expired.append(node)
            for node in expired:
                del rep.guesses[node]
                self._release(rep, node)
            removed += len(expired)
        return removed

    # Exact mode -----------------------------------------------------------------------------------------------

    def apply(self, replica: str, event: KVEvent, *, seed: bytes, now: float) -> bool:
        """Apply one of `replica`'s KV events; returns False when it was skipped (and counted as such).

        `seed` is the namespace seed (`hashing.namespace_seed`) of the model the replica serves. Exact entries
        do not expire, so `now` changes nothing today; it is taken so that every mutation has the same shape.
        Raises KeyError for a replica that is not indexed.
        """
        rep = self._replicas[replica]
        if isinstance(event, BlockStored):
            is_applied = self._apply_stored(rep, event, seed)
        elif isinstance(event, BlockRemoved):
            for engine_hash in event.block_hashes:
                self._remove_engine_block(rep, engine_hash)
            is_applied = True
        else:
            self._clear(rep)
            is_applied = True
        if is_applied:
            self._events_applied += 1
        else:
            self._events_skipped += 1
        return is_applied

    def _apply_stored(self, rep: _Replica, event: BlockStored, seed: bytes) -> bool:
        parent_hash = None
        if event.parent_hash is not None:
            parent = rep.engine_blocks.get(event.parent_hash)
            if parent is None:
                return False
            parent_hash = parent.hash
        router_hashes = hashing.hash_tokens(event.token_ids, seed, event.block_size, parent_hash=parent_hash)
        if len(router_hashes) != len(event.block_hashes):
            return False
        bit = rep.bit
        for engine_hash, block_hash in zip(event.block_hashes, router_hashes, strict=True):
            known = rep.engine_blocks.get(engine_hash)
            if known is not None:
                if known.hash == block_hash:
                    continue  # the same event again
                self._remove_engine_block(rep, engine_hash)  # the engine reused the hash for other tokens
            node = self._nodes.get(block_hash)
            if node is None:
                node = self._nodes[block_hash] = _Node(block_hash, bit, _NEVER)
                rep.num_exact += 1
            elif rep.guesses.pop(node, None) is not None:
                rep.num_exact += 1  # a guess confirmed
                if node.holders is bit:
                    node.expiry_s = _NEVER
            elif node.holders & bit:
                rep.extra_engine_refs[node] = rep.extra_engine_refs.get(node, 0) + 1
            else:
                node.holders |= bit
                rep.num_exact += 1
            rep.engine_blocks[engine_hash] = node
        return True

    def _remove_engine_block(self, rep: _Replica, engine_hash: int) -> None:
        node = rep.engine_blocks.pop(engine_hash, None)
        if node is None:
            return  # stored before we listened, or already gone
        extra = rep.extra_engine_refs.get(node, 0)
        if extra:
            if extra == 1:
                del rep.extra_engine_refs[node]
            else:
                rep.extra_engine_refs[node] = extra - 1
            return
        rep.num_exact -= 1
        self._release(rep, node)
        self._set_prefix_closed(rep, not (rep.guesses or rep.num_exact))

    # Internals ------------------------------------------------------------------------------------------------

    def _live_holders(self, node: _Node, now: float) -> int:
        """Holders of `node` whose entry is live at `now`; refreshes `node.expiry_s` to the exact bound."""
        live = 0
        bound = _NEVER
        bits = node.holders
        while bits:
            low = bits & -bits
            bits ^= low
            deadline = self._by_bit[low].guesses.get(node)
            if deadline is None:
                live |= low  # exact
                continue
            bound = min(bound, deadline)
            if deadline > now:
                live |= low
        node.expiry_s = bound
        return self._canonical(live)

    def _evict(self, rep: _Replica) -> None:
        target = int(rep.capacity_blocks * (1.0 - self.config.evict_fraction))
        victims = list(islice(rep.guesses, len(rep.guesses) - target))
        for node in victims:
            del rep.guesses[node]
            self._release(rep, node)
        self._evictions += len(victims)

    def _clear(self, rep: _Replica) -> None:
        for node in rep.guesses:
            self._release(rep, node)
        for node in set(rep.engine_blocks.values()):
            self._release(rep, node)
        rep.guesses = {}
        rep.engine_blocks = {}
        rep.extra_engine_refs = {}
        rep.num_exact = 0
        self._set_prefix_closed(rep, True)

    def _set_prefix_closed(self, rep: _Replica, is_closed: bool) -> None:
        rep.is_prefix_closed = is_closed
        if is_closed:
            self._closed_bits |= rep.bit
        else:
            self._closed_bits &= ~rep.bit

    def _release(self, rep: _Replica, node: _Node) -> None:
        """Take `rep` off `node` (the caller has dropped the entry from `rep`'s own maps)."""
        if node.holders is rep.bit:
            del self._nodes[node.hash]
        else:
            node.holders = self._canonical(node.holders ^ rep.bit)

    def _canonical(self, bits: int) -> int:
        if bits and not bits & (bits - 1):
            return self._by_bit[bits].bit
        return bits

    def _ids_in(self, bits: int) -> tuple[str, ...]:
        ids = self._ids_by_bits.get(bits)
        if ids is None:
            if len(self._ids_by_bits) >= _MAX_CACHED_MASKS:
                self._ids_by_bits.clear()
            found = []
            rest = bits
            while rest:
                low = rest & -rest
                rest ^= low
                found.append(self._by_bit[low].id)
            ids = self._ids_by_bits[bits] = tuple(found)
        return ids
