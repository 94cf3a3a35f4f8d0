"""The two wire forms of KV events the router reads: Shoal's SSE messages and vLLM's ZMQ msgpack batches.

Both decode to `router.policy.kv_events` objects; anything malformed raises `KVEventError`, which the subscriber
treats as a lost sync (resnapshot or clear), never as data. A vLLM batch raises its subclass `MalformedBatch`,
whose `kind` names the trouble among a few, so that a subscriber logs each kind once however many frames carry it.
Token ids must fit the uint32 the router hashes them as.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from router.policy.kv_events import AllCleared, BlockStored, KVEvent, KVEventError, from_dict

# vLLM's event fields in declaration order, which is their position in the array encoding (msgspec `array_like`,
# vLLM before its PR #42892; fields were only ever appended). Newer vLLM encodes each event as a map with these
# names and the tag under "type".
_VLLM_FIELDS = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",
        "kv_cache_spec_sliding_window",
    ),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}


# --- decoding ---------------------------------------------------------------------------------------------------


_MAX_TOKEN_ID = 2**32 - 1


class MalformedBatch(KVEventError):
    """A vLLM batch Shoal cannot read. `kind`: `not msgpack`, `not a batch` (not `[ts, events, ...]` nor a map with
    `events`) or `bad event`."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail


def _checked(event: KVEvent) -> KVEvent:
    tokens = event.token_ids if isinstance(event, BlockStored) else ()
    if tokens and (min(tokens) < 0 or max(tokens) > _MAX_TOKEN_ID):
        raise KVEventError("'token_ids' must lie in [0, 2**32)")
    return event


@dataclass(frozen=True, slots=True)
class SseMessage:
    seq: int
    is_snapshot: bool
    events: list[KVEvent]


def parse_sse_message(data: bytes) -> SseMessage:
    """One message of Shoal's stream: `{"seq": n, "replica": id, "snapshot"?: true, "events": [...]}`."""
    try:
        message = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise KVEventError(f"message is not JSON: {exc}") from exc
    if not isinstance(message, dict):
        raise KVEventError("message must be a JSON object")
    seq, events = message.get("seq"), message.get("events")
    if type(seq) is not int or not isinstance(events, list):
        raise KVEventError("message must carry an integer 'seq' and an 'events' array")
    if not all(isinstance(e, dict) and isinstance(e.get("type"), str) for e in events):
        raise KVEventError("each event must be a JSON object with a string 'type'")
    return SseMessage(seq, message.get("snapshot") is True, [_checked(from_dict(e)) for e in events])


@dataclass(frozen=True, slots=True)
class VllmBatch:
    events: list[tuple[KVEvent, str | None]]
    """Each event with the LoRA adapter whose namespace it belongs to (None: the base model)."""
    num_unsupported: int
    """Events left out: another medium than the GPU (CPU offload), another attention kind than full attention
    (sliding-window groups), or a LoRA adapter named by id only (vLLM before `lora_name`)."""


def decode_vllm_batch(payload: bytes) -> VllmBatch:
    """A vLLM `KVEventBatch`: `[ts, [event, ...], data_parallel_rank?]` (or the same as a map), each event a tagged
    array `["BlockStored", ...fields]` or a tagged map `{"type": "BlockStored", ...}`. Hashes may be ints or bytes.
    Raises KVEventError for anything else."""
    import msgpack  # type: ignore[import-untyped]  # only routers reading vLLM's ZMQ stream load it

    try:
        # msgpack's own errors are ValueErrors (UnpackException for some); a map keyed by an array is a TypeError.
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise MalformedBatch("not msgpack", str(exc)) from exc
    if isinstance(batch, dict):
        raw_events = batch.get("events")
    elif isinstance(batch, list) and len(batch) >= 2:
        raw_events = batch[1]
    else:
        raise MalformedBatch("not a batch", "expected [ts, events, ...] or a map with 'events'")
    if not isinstance(raw_events, list):
        raise MalformedBatch("not a batch", "a batch's events must be an array")
    events: list[tuple[KVEvent, str | None]] = []
    num_unsupported = 0
    for raw in raw_events:
        try:
            fields = _vllm_fields(raw)
            if not _is_supported(fields):
                num_unsupported += 1
                continue
            events.append(_vllm_event(fields))
        except KVEventError as exc:
            raise MalformedBatch("bad event", str(exc)) from exc
    return VllmBatch(events, num_unsupported)


def _vllm_event(fields: Mapping[str, Any]) -> tuple[KVEvent, str | None]:
    kind = fields["type"]
    if kind == "AllBlocksCleared":
        event: KVEvent = AllCleared()
    else:
        hashes = [_hash(h) for h in _list(fields.get("block_hashes"), "block_hashes")]
        parent = fields.get("parent_block_hash")
        event = _checked(
            from_dict(
                {
                    "type": kind,
                    "block_hashes": hashes,
                    "parent_hash": None if parent is None else _hash(parent),
                    "token_ids": fields.get("token_ids"),
                    "block_size": fields.get("block_size"),
                }
            )
        )
    lora_name = fields.get("lora_name")
    return event, lora_name if isinstance(lora_name, str) and lora_name else None


def _vllm_fields(raw: Any) -> dict[str, Any]:
    if isinstance(raw, dict):
        fields = raw
    elif isinstance(raw, list) and raw and isinstance(raw[0], str):
        fields = {"type": raw[0], **dict(zip(_VLLM_FIELDS.get(raw[0], ()), raw[1:], strict=False))}
    else:
        raise KVEventError("an event must be a tagged array or a tagged map")
    kind = fields.get("type")
    if not isinstance(kind, str) or kind not in _VLLM_FIELDS:
        raise KVEventError(f"unknown vLLM event type {str(kind)[:40]!r}")
    return fields


def _is_supported(fields: Mapping[str, Any]) -> bool:
    if fields.get("medium") not in (None, "GPU"):
        return False
    if fields.get("kv_cache_spec_kind") not in (None, "full_attention"):
        return False
    return not (fields["type"] == "BlockStored" and fields.get("lora_id") is not None and not fields.get("lora_name"))


def _list(value: Any, name: str) -> list[Any]:
    if not isinstance(value, list):
        raise KVEventError(f"'{name}' must be an array")
    return value


def _hash(value: Any) -> int:
    """An engine hash as an int: vLLM sends 64-bit ints, or bytes (its sha256 block hashes)."""
    if type(value) is int:
        return value
    if isinstance(value, bytes):
        return int.from_bytes(value, "big")
    raise KVEventError(f"a block hash must be an integer or bytes, got {type(value).__name__}")


# --- pacing and backoff -------------------------------------------------------------------------------------------
