"""Prefix index: which replica holds which prompt-prefix blocks (DESIGN.md, Router).

Shape. Block hashes are chained (`hashing`): a hash names its whole prefix, so the index needs no tree and no
parent links. It is dicts of ints and floats, with no object per block: CPython does not track for garbage
collection a dict whose keys and values are all ints and floats, so a full `gc.collect()` skips the index however
many blocks it holds (with a node object per block, each full collection walked them all: 160 ms at a million).
  - `holders`: block hash -> bitmask of the replica slots holding the block. A single-bit mask is always the
    replica's own `bit` object, so a block held by one replica costs no mask of its own.
  - per replica, `guesses`: block hash -> deadline of each approximate or predicted entry, oldest touch first
    (below). A block the replica holds that is not among its guesses is exact.
  - `bounds`: for a block held by more than one replica, a lower bound on the earliest deadline among its
    holders' guesses; absent when none of its holders guesses.
A block held by one replica is live while its deadline there has not passed (exact: always). A shared block whose
bound has not passed costs one float comparison; one whose bound has passed is checked holder by holder and its
bound refreshed. So an expired entry never counts, swept or not.

Dict upkeep. A dict never gives back the slots of deleted entries, and one that keeps deleting and inserting
(every touch is both) settles at twice the table a copy of it gets. A churning dict is therefore rebuilt, by a
copy CPython sizes for its live entries, once its table has grown since the last copy and the deletions since
then reach half its live entries: at most two entries copied per deletion, for some 125 bytes per entry in
steady state (`benchmarks/bench_index.py`; 260 with node objects). A copy, like a resize, stalls its caller for
as long as the dict is big, so `holders` and `bounds` are split by the hash's low bits into `_NUM_SHARDS` dicts
each, and a call rebuilds at most `_SHARD_REBUILDS_PER_CALL` of them; a replica's own dicts are bounded by its
capacity. Python cannot look up a dict's own key object, so an entry that a later record touches or adds keys on
that record's int, equal to but apart from the one `holders` keeps: 36 bytes more for each such entry. Against
one plain dict per map, never rebuilt (`benchmarks/bench_index.py`, a million blocks): 122-125 bytes per entry in
steady state instead of 212, and a slowest record of 3 ms instead of 64 (the one `holders` dict resizing at once).

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
block hash -> deadline (seconds), oldest touch first; a touch moves an entry to the end and keeps the later of its
old and new deadlines. `record` takes a prompt's hashes from block 0 and touches them leaf first, so a block is
always more recent than its descendants and expires no earlier than they do: evicting from the front, or
sweeping expired entries from the front, removes leaves before the blocks they hang from, and never orphans a
descendant. `capacity_blocks` bounds a replica's guesses; past it, the front is evicted in one batch down to
(1 - evict_fraction) x capacity. Exact entries do not count against it: the engine's own eviction bounds them,
and it tells us.

Exact mode. A `stored` event's blocks are re-hashed with the router's hash from the event's token ids, chained
from the router hash of the event's parent, found through a per-replica map engine hash -> router hash; the
engine hash is kept only to apply a later `removed`. An engine block of a multiple of the router's block size
(vLLM's 128-token blocks on CPUs, against the router's 16) is indexed as that many router blocks, which come and
go together. An event whose parent is unknown (its `stored` was missed, or the block was removed since) is
skipped and counted: chaining from the wrong parent would index the blocks under hashes no request carries.
When events were lost and cannot be replayed, `demote` turns the replica's exact entries into approximate ones
(they were true a moment ago; the TTL retires what the engine dropped since) and keeps their engine hashes for
resolving parents, so the children the engine stores next are still indexed.

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
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import TypeVar

from pydantic import BaseModel, ConfigDict, Field

from router.policy import hashing
from router.policy.kv_events import BlockRemoved, BlockStored, KVEvent

_NEVER = math.inf
_MAX_CACHED_MASKS = 4096
_NUM_SHARDS = 256
"""Shards of the block-keyed dicts: a resize or rebuild copies 1/256 of the blocks (some 40k at 10M blocks)."""
_SHARD_MASK = _NUM_SHARDS - 1
_SHARD_REBUILDS_PER_CALL = 2
"""Shards rebuilt by one call at most. Shards wear out together (hashes spread evenly); the rest wait for the
next calls, so that no call copies more than a couple of shards."""
_DELETIONS_PER_REBUILD = 0.5
"""Deletions, as a fraction of a dict's live entries, that pay for rebuilding it: each deletion pays for copying
at most two entries. 0.25 saves some 5 more bytes per entry in steady state for twice the copying; 1.0 copies
half as much and keeps some 20 more."""

_V = TypeVar("_V")


def _last_true(lo: int, hi: int, is_true: Callable[[int], bool]) -> int:
    """The last j in [lo, hi) where `is_true`, which holds at `lo` and, past some j, never again."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if is_true(mid):
            lo = mid
        else:
            hi = mid
    return lo


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


class _Churn:
    """Deletions from one dict since it was last rebuilt, and its size then: whether a rebuild would pay."""

    __slots__ = ("num_deleted", "rebuilt_bytes", "rebuilt_len")

    def __init__(self, table: dict[int, _V]) -> None:
        self.restart(table)

    def restart(self, table: dict[int, _V]) -> None:
        """Count from a freshly built `table`."""
        self.num_deleted = 0
        self.rebuilt_len = len(table)
        self.rebuilt_bytes = sys.getsizeof(table)

    def is_due(self, table: dict[int, _V]) -> bool:
        """Enough deletions to pay for a copy, and the table grew since the last one or lost half its entries."""
        num_live = len(table)
        return 0 < self.num_deleted >= num_live * _DELETIONS_PER_REBUILD and (
            sys.getsizeof(table) > self.rebuilt_bytes or 2 * num_live < self.rebuilt_len
        )

    def rebuilt(self, table: dict[int, _V]) -> dict[int, _V]:
        """A copy of `table` sized for its live entries, in the same order."""
        copy = dict(table)
        self.restart(copy)
        return copy


class _Replica:
    """One replica's entries."""

    __slots__ = (
        "bit",
        "capacity_blocks",
        "demoted_blocks",
        "engine_blocks",
        "engine_churn",
        "engine_spans",
        "extra_engine_refs",
        "guess_churn",
        "guesses",
        "id",
        "is_prefix_closed",
        "num_exact",
    )

    def __init__(self, replica_id: str, bit: int, capacity_blocks: int) -> None:
        self.id = replica_id
        self.bit = bit
        self.capacity_blocks = capacity_blocks
        self.guesses: dict[int, float] = {}
        """Block hash -> deadline in seconds of each approximate and predicted entry, oldest touch first."""
        self.guess_churn = _Churn(self.guesses)
        self.engine_blocks: dict[int, int] = {}
        """Engine hash -> router hash of the last router block of each exact engine block."""
        self.engine_churn = _Churn(self.engine_blocks)
        self.engine_spans: dict[int, tuple[int, ...]] = {}
        """Engine hash -> router hashes of the router blocks before its last one, for engine blocks larger than
        the router's: with `engine_blocks`' values, exactly the replica's exact entries."""
        self.demoted_blocks: dict[int, int] = {}
        """Engine hash -> router hash of engine blocks whose entries `demote` made approximate: parents only."""
        self.extra_engine_refs: dict[int, int] = {}
        """Exact blocks named by more than one engine hash (say, the same tokens under two cache salts): the
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
        self._holders: list[dict[int, int]] = [{} for _ in range(_NUM_SHARDS)]
        """Per shard, block hash -> bitmask of the replica slots holding it; a single bit is always the replica's
        `bit` object."""
        self._bounds: list[dict[int, float]] = [{} for _ in range(_NUM_SHARDS)]
        """Per shard, block hash of a block held by more than one replica -> at most the earliest deadline among
        its holders' guesses; absent when none of them guesses."""
        self._holders_churn = [_Churn(shard) for shard in self._holders]
        self._bounds_churn = [_Churn(shard) for shard in self._bounds]
        self._worn_shards: set[int] = set()
        """Shards with deletions enough to pay for rebuilding their dicts; `_compact_shards` decides."""
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
                self._compact(rep)
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
        self._compact_shards()

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
        holders = self._holders
        bounds = self._bounds
        mask = _SHARD_MASK
        guesses: dict[int, float] = {}

        def is_held_by_all(j: int) -> bool:
            """Whether every replica of `held` (several) has a live entry for block j."""
            block_hash = hashes[j]
            shard = block_hash & mask
            present = holders[shard].get(block_hash)
            if present is None or present & held != held:
                return False
            bound = bounds[shard].get(block_hash)
            return bound is None or bound > now or self._live_holders(block_hash, present, now) & held == held

        def is_held_by_one(j: int) -> bool:
            """Whether the one replica of `held`, whose guesses are `guesses`, has a live entry for block j."""
            block_hash = hashes[j]
            deadline = guesses.get(block_hash)
            if deadline is not None:
                return deadline > now
            present = holders[block_hash & mask].get(block_hash)
            return present is not None and present & held != 0  # exact

        num_blocks = len(hashes)
        held = self._live_at(hashes[0], now) & bits
        lo = 0
        while held:
            # Invariant: every replica in `held` holds blocks 0..lo; find the last block they all hold.
            only = self._by_bit.get(held)
            if only is None:
                lo = _last_true(lo, num_blocks, is_held_by_all)
            else:
                guesses = only.guesses
                lo = _last_true(lo, num_blocks, is_held_by_one)
            depth = lo + 1
            rest = self._live_at(hashes[depth], now) & held if depth < num_blocks else 0
            dropped.append((depth, held ^ rest))
            held = rest
            lo = depth

    def _walk(self, hashes: Sequence[int], alive: int, now: float, dropped: list[tuple[int, int]]) -> None:
        """Match for any replicas: one look-up per block, AND-ing holder masks until none is left."""
        holders = self._holders
        bounds = self._bounds
        mask = _SHARD_MASK
        only = self._by_bit.get(alive)
        num_blocks = len(hashes)
        depth = 0
        while only is None and depth < num_blocks:  # several replicas left
            block_hash = hashes[depth]
            shard = block_hash & mask
            held = holders[shard].get(block_hash)
            if held is None:
                break
            if held is alive or held == alive:  # the usual case: a run of blocks with the same holders
                bound = bounds[shard].get(block_hash)
                if bound is None or bound > now:
                    depth += 1
                    continue
            kept = self._live_at(block_hash, now) & alive
            if kept != alive:
                if depth:
                    dropped.append((depth, alive ^ kept))
                if not kept:
                    return
                # Reuse the block's own mask object when it is the new set, so that the next blocks, which
                # usually share it, pass the identity test above.
                alive = held if kept == held else kept
                only = self._by_bit.get(alive)
            depth += 1
        if only is not None:  # one replica left: its guesses answer for most blocks without `holders`
            guesses = only.guesses
            while depth < num_blocks:
                block_hash = hashes[depth]
                deadline = guesses.get(block_hash)
                if deadline is None:
                    held = holders[block_hash & mask].get(block_hash)
                    if held is None or not held & alive:
                        break
                elif deadline <= now:
                    break
                depth += 1
        if depth:
            dropped.append((depth, alive))

    def _live_at(self, block_hash: int, now: float) -> int:
        """The holders of a block whose entries are live at `now` (0 when it is not indexed)."""
        shard = block_hash & _SHARD_MASK
        held = self._holders[shard].get(block_hash)
        if held is None:
            return 0
        only = self._by_bit.get(held)
        if only is not None:
            deadline = only.guesses.get(block_hash)
            return held if deadline is None or deadline > now else 0
        bound = self._bounds[shard].get(block_hash)
        return held if bound is None or bound > now else self._live_holders(block_hash, held, now)

    def holds(self, block_hash: int) -> bool:
        """Whether any replica has an entry for the block, live or expired: when none has, no match reaches past
        it (`hashing.PromptChain.prefix` stops hashing there)."""
        return block_hash in self._holders[block_hash & _SHARD_MASK]

    def stats(self) -> IndexStats:
        per_replica = {rep.id: len(rep.guesses) + rep.num_exact for rep in self._replicas.values()}
        return IndexStats(
            num_blocks=sum(map(len, self._holders)),
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
        holders = self._holders
        mask = _SHARD_MASK
        deadline = now + (self.config.predicted_ttl_s if predicted else self.config.ttl_s)
        num_touched = 0
        # Leaf first: each block ends up more recent than all of its descendants (eviction takes leaves first).
        for block_hash in reversed(hashes):
            old = guesses.pop(block_hash, None)
            if old is not None:  # guessed already (so among the holders): a touch
                guesses[block_hash] = old if old > deadline else deadline
                num_touched += 1
                continue
            shard = holders[block_hash & mask]
            held = shard.get(block_hash)
            if held is None:
                shard[block_hash] = bit
            elif held & bit:
                continue  # exact: the engine's word outranks a guess
            else:
                self._join(rep, block_hash, held, deadline)
            guesses[block_hash] = deadline
        rep.guess_churn.num_deleted += num_touched
        if len(guesses) > rep.capacity_blocks:
            self._evict(rep)
        self._compact(rep)

    def expire(self, now: float) -> int:
        """Sweep guesses whose deadline has passed; returns the number of entries removed.

        Each replica's guesses are swept from the front of its touch order up to the first live one. A replica
        given both approximate and predicted records can hold an expired predicted entry behind a live
        approximate one: it never counts in `match`, and goes when it reaches the front or is evicted.
        """
        removed = 0
        for rep in self._replicas.values():
            expired: list[int] = []
            for block_hash, deadline in rep.guesses.items():
                if deadline > now:
                    break
                expired.append(block_hash)
            for block_hash in expired:
                del rep.guesses[block_hash]
                self._release(rep, block_hash)
            rep.guess_churn.num_deleted += len(expired)
            removed += len(expired)
            self._compact_replica(rep)
        self._compact_shards()
        return removed

    # Exact mode -----------------------------------------------------------------------------------------------

    def apply(self, replica: str, event: KVEvent, *, seed: bytes, now: float, block_size: int | None = None) -> bool:
        """Apply one of `replica`'s KV events; returns False when it was skipped (and counted as such).

        `seed` is the namespace seed (`hashing.namespace_seed`) of the model the replica serves; `block_size` is
        the router's block size in tokens (None: the event's own), which must divide the engine's. Exact entries
        do not expire, so `now` changes nothing today; it is taken so that every mutation has the same shape.
        Raises KeyError for a replica that is not indexed.
        """
        rep = self._replicas[replica]
        if isinstance(event, BlockStored):
            is_applied = self._apply_stored(rep, event, seed, block_size or event.block_size)
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
        self._compact(rep)
        return is_applied

    def demote(self, replica: str, *, now: float) -> int:
        """Events of `replica` were lost: its exact entries become approximate ones (deadline `ttl_s` after
        `now`), and their engine hashes stay known as parents. Returns the number of entries demoted."""
        rep = self._replicas[replica]
        exact: list[int] = []  # parents before children, as the engine stored them
        for engine_hash, block_hash in rep.engine_blocks.items():
            exact.extend(rep.engine_spans.get(engine_hash, ()))
            exact.append(block_hash)
        exact = list(dict.fromkeys(exact))
        was_closed = rep.is_prefix_closed
        for block_hash in exact:
            self._release(rep, block_hash)
        if len(rep.demoted_blocks) + len(rep.engine_blocks) > rep.capacity_blocks:
            rep.demoted_blocks = {}
        rep.demoted_blocks.update(rep.engine_blocks)
        rep.engine_blocks = {}
        rep.engine_churn = _Churn(rep.engine_blocks)
        rep.engine_spans = {}
        rep.extra_engine_refs = {}
        rep.num_exact = 0
        self.record(replica, exact, now=now)
        self._set_prefix_closed(rep, was_closed or not rep.guesses)
        return len(exact)

    def _apply_stored(self, rep: _Replica, event: BlockStored, seed: bytes, block_size: int) -> bool:
        engine_blocks = rep.engine_blocks
        parent_hash = None
        if event.parent_hash is not None:
            parent_hash = engine_blocks.get(event.parent_hash)
            if parent_hash is None:
                parent_hash = rep.demoted_blocks.get(event.parent_hash)
                if parent_hash is None:
                    return False
        span, rest = divmod(event.block_size, block_size)
        if span < 1 or rest:
            return False
        router_hashes = hashing.hash_tokens(event.token_ids, seed, block_size, parent_hash=parent_hash)
        if len(router_hashes) != span * len(event.block_hashes):
            return False
        for i, engine_hash in enumerate(event.block_hashes):
            last = router_hashes[(i + 1) * span - 1]
            known = engine_blocks.get(engine_hash)
            if known is not None:
                if known == last:
                    continue  # the same event again
                self._remove_engine_block(rep, engine_hash)  # the engine reused the hash for other tokens
            if span > 1:
                inner = tuple(router_hashes[i * span : (i + 1) * span - 1])
                rep.engine_spans[engine_hash] = inner
                for block_hash in inner:
                    self._hold_exact(rep, block_hash)
            self._hold_exact(rep, last)
            engine_blocks[engine_hash] = last
        return True

    def _hold_exact(self, rep: _Replica, block_hash: int) -> None:
        shard = self._holders[block_hash & _SHARD_MASK]
        held = shard.get(block_hash)
        if held is None:
            shard[block_hash] = rep.bit
            rep.num_exact += 1
        elif rep.guesses.pop(block_hash, None) is not None:
            rep.num_exact += 1  # a guess confirmed
            rep.guess_churn.num_deleted += 1
        elif held & rep.bit:
            rep.extra_engine_refs[block_hash] = rep.extra_engine_refs.get(block_hash, 0) + 1
        else:
            self._join(rep, block_hash, held, None)
            rep.num_exact += 1

    def _remove_engine_block(self, rep: _Replica, engine_hash: int) -> None:
        block_hash = rep.engine_blocks.pop(engine_hash, None)
        if block_hash is None:
            return  # stored before we listened, or already gone
        rep.engine_churn.num_deleted += 1
        for inner in rep.engine_spans.pop(engine_hash, ()):
            self._drop_exact(rep, inner)
        self._drop_exact(rep, block_hash)
        self._set_prefix_closed(rep, not (rep.guesses or rep.num_exact))

    def _drop_exact(self, rep: _Replica, block_hash: int) -> None:
        extra = rep.extra_engine_refs.get(block_hash, 0)
        if extra:
            if extra == 1:
                del rep.extra_engine_refs[block_hash]
            else:
                rep.extra_engine_refs[block_hash] = extra - 1
            return
        rep.num_exact -= 1
        self._release(rep, block_hash)

    # Internals ------------------------------------------------------------------------------------------------

    def _live_holders(self, block_hash: int, held: int, now: float) -> int:
        """Holders in `held` whose entry for a shared block is live at `now`; refreshes the block's bound to the
        earliest deadline among them (the caller found the bound present and passed)."""
        live = 0
        bound = _NEVER
        bits = held
        while bits:
            low = bits & -bits
            bits ^= low
            deadline = self._by_bit[low].guesses.get(block_hash)
            if deadline is None:
                live |= low  # exact
                continue
            bound = min(bound, deadline)
            if deadline > now:
                live |= low
        self._bounds[block_hash & _SHARD_MASK][block_hash] = bound
        return held if live == held else self._canonical(live)

    def _join(self, rep: _Replica, block_hash: int, held: int, deadline: float | None) -> None:
        """Add `rep` to the holders of an indexed block it does not hold, as a guess expiring at `deadline`, or
        as an exact entry when it is None; the caller adds the entry to `rep`'s own maps."""
        shard = block_hash & _SHARD_MASK
        self._holders[shard][block_hash] = held | rep.bit
        bounds = self._bounds[shard]
        bound = _NEVER if deadline is None else deadline
        only = self._by_bit.get(held)
        if only is not None:  # the block becomes shared: its bound starts from its first holder's deadline
            first = only.guesses.get(block_hash)
            if first is not None and first < bound:
                bound = first
        else:
            bound = min(bound, bounds.get(block_hash, _NEVER))
        if bound < _NEVER:
            bounds[block_hash] = bound

    def _release(self, rep: _Replica, block_hash: int) -> None:
        """Take `rep` off a block's holders (the caller has dropped the entry from `rep`'s own maps)."""
        shard = block_hash & _SHARD_MASK
        holders = self._holders[shard]
        held = holders[block_hash]
        if held == rep.bit:
            del holders[block_hash]
            churn = self._holders_churn[shard]
            churn.num_deleted += 1
            if churn.num_deleted >= len(holders) * _DELETIONS_PER_REBUILD:
                self._worn_shards.add(shard)
            return
        rest = held ^ rep.bit
        only = self._by_bit.get(rest)
        if only is None:
            holders[block_hash] = rest
            return
        holders[block_hash] = only.bit  # no longer shared: its holder's own deadline is its bound
        bounds = self._bounds[shard]
        if bounds.pop(block_hash, None) is not None:
            churn = self._bounds_churn[shard]
            churn.num_deleted += 1
            if churn.num_deleted >= len(bounds) * _DELETIONS_PER_REBUILD:
                self._worn_shards.add(shard)

    def _evict(self, rep: _Replica) -> None:
        target = int(rep.capacity_blocks * (1.0 - self.config.evict_fraction))
        victims = list(islice(rep.guesses, len(rep.guesses) - target))
        for block_hash in victims:
            del rep.guesses[block_hash]
            self._release(rep, block_hash)
        rep.guess_churn.num_deleted += len(victims)
        self._evictions += len(victims)

    def _clear(self, rep: _Replica) -> None:
        for block_hash in rep.guesses:
            self._release(rep, block_hash)
        for block_hash in {*rep.engine_blocks.values(), *(h for span in rep.engine_spans.values() for h in span)}:
            self._release(rep, block_hash)
        rep.guesses = {}
        rep.guess_churn = _Churn(rep.guesses)
        rep.engine_blocks = {}
        rep.engine_churn = _Churn(rep.engine_blocks)
        rep.engine_spans = {}
        rep.demoted_blocks = {}
        rep.extra_engine_refs = {}
        rep.num_exact = 0
        self._set_prefix_closed(rep, True)

    def _compact(self, rep: _Replica) -> None:
        self._compact_replica(rep)
        self._compact_shards()

    def _compact_replica(self, rep: _Replica) -> None:
        if rep.guess_churn.is_due(rep.guesses):
            rep.guesses = rep.guess_churn.rebuilt(rep.guesses)
        if rep.engine_churn.is_due(rep.engine_blocks):
            rep.engine_blocks = rep.engine_churn.rebuilt(rep.engine_blocks)

    def _compact_shards(self) -> None:
        for _ in range(min(len(self._worn_shards), _SHARD_REBUILDS_PER_CALL)):
            shard = self._worn_shards.pop()
            if self._holders_churn[shard].is_due(self._holders[shard]):
                self._holders[shard] = self._holders_churn[shard].rebuilt(self._holders[shard])
            if self._bounds_churn[shard].is_due(self._bounds[shard]):
                self._bounds[shard] = self._bounds_churn[shard].rebuilt(self._bounds[shard])

    def _set_prefix_closed(self, rep: _Replica, is_closed: bool) -> None:
        rep.is_prefix_closed = is_closed
        if is_closed:
            self._closed_bits |= rep.bit
        else:
            self._closed_bits &= ~rep.bit

    def _canonical(self, bits: int) -> int:
        only = self._by_bit.get(bits)
        return bits if only is None else only.bit

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
