"""KV-event wire forms the router reads: vLLM's msgpack batches (array and map encodings), Shoal's SSE messages and
their framing, and the pacing and backoff of the subscribers.

The vLLM payloads are built field by field from vLLM's own definitions (vllm/distributed/kv_events.py): msgspec
structs with `tag=True`, encoded as positional arrays (`array_like=True`) before vLLM PR #42892 and as maps with
the tag under "type" after it; the batch stays `[ts, events, data_parallel_rank]`.
"""

from __future__ import annotations

import asyncio

import msgpack  # type: ignore[import-untyped]
import orjson
import pytest
from aiohttp import StreamReader
from aiohttp.base_protocol import BaseProtocol

from router.policy.kv_events import AllCleared, BlockRemoved, BlockStored, KVEvent, KVEventError, to_dict
from router.service.kv_event_wire import MalformedBatch, decode_vllm_batch, parse_sse_message
from router.service.kv_events import Pacer, backoff_s, sse_data
from router.service.settings import KVEventSettings

TOKENS = list(range(32))


def batch(*events: object, dp_rank: int | None = 0) -> bytes:
    body: list[object] = [1_700_000_000.5, list(events)]
    if dp_rank is not None:
        body.append(dp_rank)
    return msgpack.packb(body)  # type: ignore[no-any-return]


def test_array_encoded_events_with_medium_and_rank() -> None:
    decoded = decode_vllm_batch(
        batch(
            ["BlockStored", [11, 12], None, TOKENS, 16, None, "GPU"],
            ["BlockStored", [13], 12, TOKENS[:16], 16, None, "GPU"],
            ["BlockRemoved", [13], "GPU"],
            ["AllBlocksCleared"],
        )
    )
    assert [e for e, _ in decoded.events] == [
        BlockStored((11, 12), None, tuple(TOKENS), 16),
        BlockStored((13,), 12, tuple(TOKENS[:16]), 16),
        BlockRemoved((13,)),
        AllCleared(),
    ]
    assert decoded.num_unsupported == 0


def test_the_first_array_encoding_without_medium_nor_rank() -> None:
    decoded = decode_vllm_batch(
        batch(["BlockStored", [1], None, TOKENS[:16], 16, None], ["BlockRemoved", [1]], dp_rank=None)
    )
    assert [e for e, _ in decoded.events] == [BlockStored((1,), None, tuple(TOKENS[:16]), 16), BlockRemoved((1,))]


def test_map_encoded_events_ignore_fields_they_do_not_know() -> None:
    stored = {
        "type": "BlockStored",
        "block_hashes": [15760518052499183552],
        "parent_block_hash": None,
        "token_ids": TOKENS[:16],
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [None],
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
        "some_future_field": {"x": 1},
    }
    decoded = decode_vllm_batch(batch(stored, {"type": "BlockRemoved", "block_hashes": [15760518052499183552]}))
    assert [e for e, _ in decoded.events] == [
        BlockStored((15760518052499183552,), None, tuple(TOKENS[:16]), 16),
        BlockRemoved((15760518052499183552,)),
    ]


def test_a_map_encoded_batch_is_read_too() -> None:
    payload = msgpack.packb({"ts": 1.0, "events": [{"type": "AllBlocksCleared"}], "data_parallel_rank": 0})
    assert [e for e, _ in decode_vllm_batch(payload).events] == [AllCleared()]


def test_bytes_hashes_become_ints_consistently() -> None:
    h1, h2 = b"\x01" * 32, b"\x02" * 32
    decoded = decode_vllm_batch(
        batch(["BlockStored", [h2], h1, TOKENS[:16], 16, None, "GPU"], ["BlockRemoved", [h2], "GPU"])
    )
    stored, removed = (e for e, _ in decoded.events)
    assert isinstance(stored, BlockStored) and isinstance(removed, BlockRemoved)
    assert stored.parent_hash == int.from_bytes(h1, "big")
    assert stored.block_hashes == removed.block_hashes == (int.from_bytes(h2, "big"),)


def test_lora_events_name_their_adapter() -> None:
    decoded = decode_vllm_batch(batch(["BlockStored", [1], None, TOKENS[:16], 16, 7, "GPU", "sql-lora"]))
    assert [adapter for _, adapter in decoded.events] == ["sql-lora"]


@pytest.mark.parametrize(
    "event",
    [
        ["BlockStored", [1], None, TOKENS[:16], 16, None, "CPU"],  # CPU offload tier
        ["BlockRemoved", [1], "CPU"],
        ["BlockStored", [1], None, TOKENS[:16], 16, 3, "GPU"],  # a LoRA named by id only
        {
            "type": "BlockStored",
            "block_hashes": [1],
            "parent_block_hash": None,
            "token_ids": TOKENS[:16],
            "block_size": 16,
            "kv_cache_spec_kind": "sliding_window",
        },
    ],
)
def test_events_the_prefix_index_cannot_use_are_counted_not_applied(event: object) -> None:
    decoded = decode_vllm_batch(batch(event))
    assert (decoded.events, decoded.num_unsupported) == ([], 1)


@pytest.mark.parametrize(
    ("payload", "kind"),
    [
        (b"\xc1", "not msgpack"),  # never used in msgpack
        (b"\x81\x91\x01\x02", "not msgpack"),  # a map keyed by an array: no Python dict holds it
        (b"\x91" * 100_000 + b"\xc0", "not msgpack"),  # nested past msgpack's stack
        (msgpack.packb("not a batch"), "not a batch"),
        (msgpack.packb([1.0]), "not a batch"),
        (msgpack.packb([1.0, {"a": 1}]), "not a batch"),
        (batch(["Mystery", [1]]), "bad event"),
        (batch([17]), "bad event"),
        (batch({"type": ["BlockStored"]}), "bad event"),  # a tag that is no string (no dict key either)
        (batch(["BlockStored", [1], None, TOKENS[:15], 16, None, "GPU"]), "bad event"),  # tokens do not fill the block
        (batch(["BlockStored", ["h"], None, TOKENS[:16], 16, None, "GPU"]), "bad event"),
        (batch(["BlockStored", [1], None, [2**32] * 16, 16, None, "GPU"]), "bad event"),  # no uint32 token id
        (batch(["BlockStored", [1], None, [-1] * 16, 16, None, "GPU"]), "bad event"),
        (batch(["BlockRemoved", 5, "GPU"]), "bad event"),
    ],
)
def test_malformed_batches_raise_and_say_which_kind(payload: bytes, kind: str) -> None:
    with pytest.raises(MalformedBatch) as raised:
        decode_vllm_batch(payload)
    assert raised.value.kind == kind


def test_sse_message_parses_shoal_events() -> None:
    events: list[KVEvent] = [AllCleared(), BlockStored((5,), None, tuple(TOKENS[:16]), 16), BlockRemoved((5,))]
    data = orjson.dumps({"seq": 4, "replica": "r", "snapshot": True, "events": [to_dict(e) for e in events]})
    message = parse_sse_message(data)
    assert (message.seq, message.is_snapshot, message.events) == (4, True, events)
    assert parse_sse_message(b'{"seq": 5, "replica": "r", "events": []}').is_snapshot is False


@pytest.mark.parametrize(
    "data",
    [
        b"{",
        b"[]",
        b'{"events": []}',
        b'{"seq": 1, "events": [1]}',
        b'{"seq": 1, "events": [{"type": ["stored"]}]}',
        b'{"seq": 1, "events": [{"type": "stored", "block_hashes": [1], "parent_hash": null, "token_ids": [%b], '
        b'"block_size": 1}]}' % str(2**32).encode(),
    ],
)
def test_malformed_sse_messages_raise(data: bytes) -> None:
    with pytest.raises(KVEventError):
        parse_sse_message(data)


async def _frames(chunks: list[bytes], max_bytes: int = 1 << 20) -> list[bytes]:
    reader = StreamReader(BaseProtocol(asyncio.get_running_loop()), 2**22, loop=asyncio.get_running_loop())
    for chunk in chunks:
        reader.feed_data(chunk)
    reader.feed_eof()
    return [data async for data in sse_data(reader, max_bytes)]


async def test_sse_framing_across_chunks_comments_and_multiline_data() -> None:
    stream = b': keepalive\n\ndata: {"a":\r\ndata:1}\n\nevent: x\ndata: two\n\n' + b"data: " + b"x" * 300_000 + b"\n\n"
    chunks = [stream[i : i + 7] for i in range(0, 196, 7)] + [stream[196:]]  # lines split across chunks
    assert await _frames(chunks) == [b'{"a":\n1}', b"two", b"x" * 300_000]


async def test_sse_message_over_the_limit_ends_the_stream() -> None:
    from router.service.kv_events import _StreamEnded

    with pytest.raises(_StreamEnded):
        await _frames([b"data: " + b"x" * 5000], max_bytes=4096)


def test_pacer_lets_a_burst_through_then_spaces_blocks_at_the_rate() -> None:
    pacer = Pacer(blocks_per_s=1000.0, burst_s=0.05)
    assert pacer.delay_s(50, now=10.0) == 0.0  # the burst: 50 ms worth
    assert pacer.delay_s(100, now=10.0) == pytest.approx(0.1)
    assert pacer.delay_s(1, now=100.0) == 0.0  # idle long enough: a fresh burst


def test_backoff_doubles_up_to_its_bound_with_jitter() -> None:
    s = KVEventSettings(reconnect_min_s=0.5, reconnect_max_s=4.0)
    assert [backoff_s(n, s, 1.0) for n in (1, 2, 3, 4, 5, 50)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert backoff_s(2, s, 0.5) == 0.5
    with pytest.raises(ValueError, match="reconnect_max_s"):
        KVEventSettings(reconnect_min_s=5.0, reconnect_max_s=1.0)
