"""`shoal simulate fetch-traces`: download the public traces the scenarios replay, checked by sha256.

Each trace comes from its published repository at a pinned commit, so the bytes never change and a checksum can
name them: Mooncake's synthetic trace (kvcache-ai/Mooncake, `FAST25-release/traces/`), the Azure LLM inference
2023 traces (Azure/AzurePublicDataset, `data/`) and ServeGen's per-client rate files (alibaba/ServeGen, `data/`).
ServeGen publishes one file per client and per model; the scenarios read one curve per model, so its 422 files
are summed per 600 s window into `servegen/servegen_aggregate_rate.csv` (`aggregate_servegen`), and the checksum
is that of the result.

A file lands in the traces directory only whole and checked: bytes go to `NAME.partial` beside it, are hashed on
the way, and are renamed into place (`os.replace`, atomic on one filesystem) only if the sha256 matches; otherwise
the partial file is removed and a `FetchError` names the file and both checksums. A file already present with
the right checksum is not downloaded again. Progress (bytes, rate) goes to stderr.

`base_url` (`--base-url`, $SHOAL_TRACES_BASE_URL) replaces every source's location by a mirror laid out as
`BASE/<trace>/<file>`, e.g. `BASE/mooncake/synthetic_trace.jsonl` or `BASE/servegen/language/m-large/
chunk-0-trace.csv`: for a machine without access to GitHub, and for the tests' local server.
"""

from __future__ import annotations

import csv
import hashlib
import io
import os
import urllib.error
import urllib.request
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from http.client import HTTPException
from pathlib import Path
from typing import IO, Any

BASE_URL_ENV = "SHOAL_TRACES_BASE_URL"
"""The environment variable naming a mirror of every trace source (`--base-url` wins)."""

TIMEOUT_S = 60.0
"""Seconds without a byte before a download fails: generous for a slow link, short of hanging forever."""

_CHUNK_BYTES = 1 << 16


class FetchError(Exception):
    """A trace could not be downloaded or did not match its checksum; the message says which and why."""


@dataclass(frozen=True)
class TraceFile:
    """One file of the traces directory and where its bytes come from."""

    path: str
    """Path under the traces directory, as the scenario files name it."""
    sha256: str
    sources: tuple[str, ...]
    """Paths under the trace's base URL: one file saved as it is, or the inputs of `build`."""
    download_bytes: int
    """Bytes of all `sources` together, for the progress bar."""
    build: Callable[[Sequence[tuple[str, bytes]]], bytes] | None = None
    """Makes the file from its sources' (path, bytes); None: the one source is the file."""


@dataclass(frozen=True)
class TraceSource:
    """One public trace: a name for `--only`, its published location and the files it gives."""

    name: str
    base_url: str
    files: tuple[TraceFile, ...]
    description: str


_SERVEGEN_HEADER = (
    "category",
    "model",
    "window_start_s",
    "total_rate_req_per_s",
    "active_clients",
    "rate_weighted_mean_iat_cv",
)
_SERVEGEN_CLIENTS = {
    "language/m-large": 162,
    "language/m-mid": 109,
    "language/m-small": 43,
    "multimodal/mm-image": 35,
    "reason/deepseek-r1": 73,
}
"""Clients (files `chunk-0-trace.csv` .. `chunk-{n-1}-trace.csv`) per model at the pinned ServeGen commit."""


def aggregate_servegen(files: Sequence[tuple[str, bytes]]) -> bytes:
    """ServeGen's per-client rate files summed per model and window.

    Each input is `CATEGORY/MODEL/chunk-I-trace.csv`, rows `window_start_s, rate, cv, pattern, a, b` (rate 0 and
    no pattern: the client sent nothing in that window). Each output row is a model's window: the summed rate, the
    clients with a non-zero rate, and their inter-arrival CV weighted by rate (empty when no client sent anything),
    sorted by category, model and window; CSV with CRLF line ends, rates to 6 decimals, CVs to 4.
    """
    total: dict[tuple[str, str], dict[int, float]] = defaultdict(lambda: defaultdict(float))
    active: dict[tuple[str, str], dict[int, int]] = defaultdict(lambda: defaultdict(int))
    weighted_cv: dict[tuple[str, str], dict[int, float]] = defaultdict(lambda: defaultdict(float))
    for path, data in sorted(files, key=lambda item: _client_order(item[0])):
        category, model, _ = path.split("/")
        key = (category, model)
        for line_number, line in enumerate(data.decode().splitlines(), 1):
            fields = line.split(",")
            if len(fields) != 6:
                raise FetchError(f"{path}, line {line_number}: expected 6 comma-separated fields, got {line!r}")
            window_s, rate, cv = int(fields[0]), float(fields[1]), float(fields[2])
            total[key][window_s] += rate
            active[key][window_s] += rate > 0
            if rate > 0:
                weighted_cv[key][window_s] += rate * cv
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\r\n")
    writer.writerow(_SERVEGEN_HEADER)
    for key in sorted(total):
        for window_s in sorted(total[key]):
            rate = total[key][window_s]
            mean_cv: float | str = round(weighted_cv[key][window_s] / rate, 4) if rate > 0 else ""
            writer.writerow([*key, window_s, round(rate, 6), active[key][window_s], mean_cv])
    return out.getvalue().encode()


def _client_order(path: str) -> tuple[str, str, int]:
    category, model, name = path.split("/")
    return category, model, int(name.split("-")[1])


TRACES: tuple[TraceSource, ...] = (
    TraceSource(
        name="mooncake",
        base_url="https://raw.githubusercontent.com/kvcache-ai/Mooncake/"
        "3cca71daccf2a7afb8fe3f0295358f70e3a69fdb/FAST25-release/traces",
        files=(
            TraceFile(
                path="mooncake/synthetic_trace.jsonl",
                sha256="bd070915a98fc0ed264d7cfef2ce746002eb3076a695ec31ba2674c0111ec131",
                sources=("synthetic_trace.jsonl",),
                download_bytes=1136313,
            ),
        ),
        description="Mooncake synthetic trace (Kimi, USENIX FAST'25), Apache-2.0",
    ),
    TraceSource(
        name="azure",
        base_url="https://raw.githubusercontent.com/Azure/AzurePublicDataset/"
        "790921015d50dd6aae7f7e47f39ba0e235ad6b08/data",
        files=(
            TraceFile(
                path="azure-llm-2023/AzureLLMInferenceTrace_code.csv",
                sha256="54e9a6d2a4bd06ba1e060304b900abbc74cbea53de96506e60fe5bb4f2277fb6",
                sources=("AzureLLMInferenceTrace_code.csv",),
                download_bytes=320117,
            ),
            TraceFile(
                path="azure-llm-2023/AzureLLMInferenceTrace_conv.csv",
                sha256="2f1e5b666d4e3055fdbba98598ce2ec307767b9064e03e2fa46676dbcc7d0bf8",
                sources=("AzureLLMInferenceTrace_conv.csv",),
                download_bytes=719188,
            ),
        ),
        description="Azure LLM inference traces 2023 (Splitwise, ISCA'24), CC-BY-4.0",
    ),
    TraceSource(
        name="servegen",
        base_url="https://raw.githubusercontent.com/alibaba/ServeGen/f891d1189eb32b3868dfc443800c4150548c282a/data",
        files=(
            TraceFile(
                path="servegen/servegen_aggregate_rate.csv",
                sha256="45ad8c51c1cc9102709845ffd91bf4002d40e161132e1fa4dbf98651d43adcb8",
                sources=tuple(
                    f"{model}/chunk-{i}-trace.csv" for model, n in _SERVEGEN_CLIENTS.items() for i in range(n)
                ),
                download_bytes=28462531,
                build=aggregate_servegen,
            ),
        ),
        description="ServeGen per-client rates (Alibaba Bailian, NSDI'26), summed per model, Apache-2.0",
    ),
)

TRACE_NAMES = tuple(source.name for source in TRACES)


def source_of(path: str | Path) -> TraceSource | None:
    """The trace that gives the file at `path` (relative to the traces directory), if any does."""
    wanted = Path(path).as_posix()
    return next((s for s in TRACES if any(f.path == wanted for f in s.files)), None)


def fetch_command(traces_dir: str | Path | None, path: str | Path | None = None) -> str:
    """The command that downloads the file at `path` (or every trace) into `traces_dir`."""
    words = ["shoal simulate fetch-traces", f"--traces-dir {traces_dir if traces_dir is not None else 'DIR'}"]
    source = source_of(path) if path is not None else None
    if source is not None:
        words.append(f"--only {source.name}")
    return " ".join(words)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def fetch_traces(
    traces_dir: Path,
    *,
    only: Iterable[str] | None = None,
    base_url: str | None = None,
    sources: Sequence[TraceSource] = TRACES,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> list[tuple[str, str]]:
    """Download the traces named in `only` (all without it) into `traces_dir`; (path, what happened) per file,
    what happened being `present` or `downloaded`. Raises `FetchError` at the first file that fails."""
    names = list(only) if only else [s.name for s in sources]
    by_name = {s.name: s for s in sources}
    unknown = [name for name in names if name not in by_name]
    if unknown:
        raise FetchError(f"unknown trace {', '.join(map(repr, unknown))}: choose from {', '.join(by_name)}")
    done: list[tuple[str, str]] = []
    for name in names:
        source = by_name[name]
        base = f"{base_url.rstrip('/')}/{source.name}" if base_url else source.base_url
        for file in source.files:
            dest = traces_dir / file.path
            if dest.is_file():
                if sha256_of(dest) == file.sha256:
                    log(f"{file.path}: present, checksum ok")
                    done.append((file.path, "present"))
                    continue
                log(f"{file.path}: present with another checksum, downloading it again")
            _fetch_file(file, dest, base, progress=progress)
            log(f"{file.path}: downloaded, checksum ok")
            done.append((file.path, "downloaded"))
    return done


def _fetch_file(file: TraceFile, dest: Path, base: str, *, progress: bool) -> None:
    from tqdm import tqdm  # type: ignore[import-untyped]

    dest.parent.mkdir(parents=True, exist_ok=True)
    with tqdm(
        total=file.download_bytes,
        desc=file.path,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        disable=not progress,
        leave=False,
    ) as bar:
        if file.build is None:
            (source,) = file.sources
            _write_checked(dest, _download(f"{base}/{source}", bar.update), file.sha256)
        else:
            inputs = [(source, b"".join(_download(f"{base}/{source}", bar.update))) for source in file.sources]
            _write_checked(dest, iter([file.build(inputs)]), file.sha256)


def _download(url: str, on_bytes: Callable[[int], Any]) -> Iterator[bytes]:
    """The body of `url` in chunks; a `FetchError` naming the URL on any HTTP or network failure."""
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
            while chunk := response.read(_CHUNK_BYTES):
                on_bytes(len(chunk))
                yield chunk
    except urllib.error.HTTPError as exc:
        raise FetchError(f"GET {url}: HTTP {exc.code} {exc.reason}") from exc
    except urllib.error.URLError as exc:
        raise FetchError(f"GET {url}: {exc.reason} (no network? {BASE_URL_ENV} or --base-url names a mirror)") from exc
    except (OSError, HTTPException) as exc:  # timeouts, resets, a body cut short
        raise FetchError(f"GET {url}: {exc!r}") from exc


def _write_checked(dest: Path, chunks: Iterator[bytes], sha256: str) -> None:
    """`chunks` into `dest` if their sha256 is `sha256`, through `dest.partial` so `dest` is whole or absent."""
    partial = dest.with_name(dest.name + ".partial")
    digest = hashlib.sha256()
    try:
        with partial.open("wb") as f:
            _copy(chunks, f, digest)
            f.flush()
            os.fsync(f.fileno())
        if digest.hexdigest() != sha256:
            raise FetchError(
                f"{dest}: sha256 {digest.hexdigest()} is not the expected {sha256}; the download was removed "
                "(a changed upstream file or a bad mirror)"
            )
        os.replace(partial, dest)
    finally:
        partial.unlink(missing_ok=True)


def _copy(chunks: Iterator[bytes], f: IO[bytes], digest: Any) -> None:
    for chunk in chunks:
        digest.update(chunk)
        f.write(chunk)
