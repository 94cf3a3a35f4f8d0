"""The capture format: one `CaptureRecord` per JSON line, `{"v": 1, ...}`, in files numbered in sequence.

A record keeps a request's prompt and output token ids exactly as the engine saw and emitted them, so a drafter
trained on captures learns the model's own tokenisation, never text decoded and encoded again. Text (the prompt, the
output, stop strings) is kept only when the replica is told to (`capture_text="full"`): `CaptureSource.record` is
the one place where that choice is applied.

Files are `capture-00000001.jsonl`, `capture-00000002.jsonl`, ...: names sort by number, so the reader replays them
in the order they were written, and a writer never reuses a name that is already in the directory when it starts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

import orjson
from pydantic import ConfigDict, TypeAdapter, ValidationError

from replica.engine.sampling import SamplingParams

FORMAT_VERSION = 1
"""The `"v"` of every line; a reader skips lines of other versions."""
Endpoint = Literal["chat", "completions"]

_FILE_NAME = re.compile(r"capture-(\d{8,})\.jsonl")


@dataclass(frozen=True)
class CaptureRecord:
    """One served request, finished, at a stop string, or aborted (`finish_reason="abort"`)."""

    __pydantic_config__ = ConfigDict(strict=True, extra="ignore")  # ids stay ints: 1.0 or "1" is not a token

    request_id: str
    endpoint: Endpoint
    model: str
    """The served model name."""
    model_hash: str
    """`fingerprint_model` of the checkpoint that produced the output."""
    tokenizer_hash: str
    """`fingerprint_tokenizer` of its tokenizer.json: ids mean nothing without the vocabulary."""
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    """Every id the engine generated for the request, in order, including any the server then cut at a stop string."""
    params: dict[str, Any]
    """The request's sampling parameters (`sampling_params_dict`)."""
    constrained: str | None
    """The output constraint (say `json_schema`); None for free generation."""
    finish_reason: str
    num_cached_tokens: int
    """Prompt tokens found in the prefix cache."""
    arrival_unix_s: float
    ttft_s: float | None
    """Arrival to first token; None if the request ended before one."""
    e2e_s: float
    """Arrival to the end of the request."""
    prompt_text: str | None = None
    """Only with `capture_text="full"`: the rendered chat prompt or the completion prompt."""
    output_text: str | None = None
    """Only with `capture_text="full"`: the text returned to the client."""


_ADAPTER = TypeAdapter(CaptureRecord)
_TEXT_FIELDS = ("prompt_text", "output_text")


def encode_record(record: CaptureRecord) -> bytes:
    """One line of a capture file, newline included; text fields that are None are left out."""
    body: dict[str, Any] = {"v": FORMAT_VERSION}
    for f in fields(record):
        value = getattr(record, f.name)
        if value is not None or f.name not in _TEXT_FIELDS:
            body[f.name] = value
    return orjson.dumps(body) + b"\n"


def decode_record(line: bytes) -> CaptureRecord:
    """The record on one line; ValueError if it is not a version-1 record with fields of the right types."""
    try:
        version = orjson.loads(line).get("v")
    except (orjson.JSONDecodeError, AttributeError) as exc:
        raise ValueError(f"not a JSON object: {exc}") from None
    if version != FORMAT_VERSION:
        raise ValueError(f"format version {version!r}, not {FORMAT_VERSION}")
    try:
        return _ADAPTER.validate_json(line)
    except ValidationError as exc:
        raise ValueError(str(exc)) from None


def sampling_params_dict(params: SamplingParams, *, keep_text: bool) -> dict[str, Any]:
    """`params` as JSON; stop strings are text, so without `keep_text` only their number is kept."""
    out: dict[str, Any] = {
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "max_tokens": params.max_tokens,
        "seed": params.seed,
        "stop_token_ids": sorted(params.stop_token_ids),
        "ignore_eos": params.ignore_eos,
        "num_stop_strings": len(params.stop),
    }
    if keep_text:
        out["stop"] = list(params.stop)
    return out


@dataclass(frozen=True)
class CaptureSource:
    """What every record of one replica shares: the served model, its fingerprints, and whether text is kept."""

    model: str
    model_hash: str
    tokenizer_hash: str
    keep_text: bool

    def record(
        self,
        *,
        request_id: str,
        endpoint: Endpoint,
        prompt_token_ids: list[int],
        output_token_ids: list[int],
        params: SamplingParams,
        finish_reason: str,
        num_cached_tokens: int,
        arrival_unix_s: float,
        ttft_s: float | None,
        e2e_s: float,
        prompt_text: str | None,
        output_text: str | None,
    ) -> CaptureRecord:
        return CaptureRecord(
            request_id=request_id,
            endpoint=endpoint,
            model=self.model,
            model_hash=self.model_hash,
            tokenizer_hash=self.tokenizer_hash,
            prompt_token_ids=prompt_token_ids,
            output_token_ids=output_token_ids,
            params=sampling_params_dict(params, keep_text=self.keep_text),
            constrained=None,  # no constrained decoding yet
            finish_reason=finish_reason,
            num_cached_tokens=num_cached_tokens,
            arrival_unix_s=arrival_unix_s,
            ttft_s=ttft_s,
            e2e_s=e2e_s,
            prompt_text=prompt_text if self.keep_text else None,
            output_text=output_text if self.keep_text else None,
        )


def capture_file_name(seq: int) -> str:
    return f"capture-{seq:08d}.jsonl"


def capture_files(directory: Path) -> list[tuple[int, Path]]:
    """(sequence number, path) of the capture files in `directory`, in sequence order; [] if it does not exist."""
    try:
        names = [entry.name for entry in directory.iterdir()]
    except FileNotFoundError:
        return []
    found = [(int(m.group(1)), directory / name) for name in names if (m := _FILE_NAME.fullmatch(name))]
    return sorted(found)
