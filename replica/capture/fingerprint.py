"""Fingerprints (sha256 hex) of a checkpoint and its tokenizer, stamped on every capture record.

A drafter must learn from outputs of the model it will serve beside, with the vocabulary they were produced in; the
fingerprints let a trainer keep the records that match. The model's covers config.json and, for each
`*.safetensors` file in name order, its name, size and a digest of its contents: all of them up to 1 GiB, else
the first and last 64 MiB, so a replica starting on a checkpoint of hundreds of GB reads a few hundred MB, not all
of it. They are computed once, at startup, and only when capture is on.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

FULL_DIGEST_MAX_BYTES = 1 << 30
"""Weight files up to this size are digested whole."""
EDGE_DIGEST_BYTES = 64 << 20
"""Of a larger weight file, this many bytes from each end are digested."""
_CHUNK_BYTES = 1 << 20


def fingerprint_model(checkpoint_dir: Path) -> str:
    h = hashlib.sha256()
    config = (checkpoint_dir / "config.json").read_bytes()
    h.update(len(config).to_bytes(8, "little") + config)
    for path in sorted(checkpoint_dir.glob("*.safetensors")):
        size_bytes = path.stat().st_size
        h.update(f"{path.name}\0{size_bytes}\0{_file_digest(path, size_bytes)}\n".encode())
    return h.hexdigest()


def fingerprint_tokenizer(path: Path) -> str:
    """`path` is tokenizer.json."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _file_digest(path: Path, size_bytes: int) -> str:
    h = hashlib.sha256()
    if size_bytes <= FULL_DIGEST_MAX_BYTES:
        spans = [(0, size_bytes)]
    else:
        spans = [(0, EDGE_DIGEST_BYTES), (size_bytes - EDGE_DIGEST_BYTES, EDGE_DIGEST_BYTES)]
    with path.open("rb") as f:
        for start, length in spans:
            f.seek(start)
            while length > 0:
                chunk = f.read(min(_CHUNK_BYTES, length))
                if not chunk:
                    break
                h.update(chunk)
                length -= len(chunk)
    return h.hexdigest()
