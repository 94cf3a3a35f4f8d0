"""`shoal simulate fetch-traces` against a local HTTP server: files land whole and checked, present ones are kept,
a wrong checksum or a failed request leaves nothing behind and says why, and ServeGen's per-client files are summed
into the one curve per model that the scenarios read."""

from __future__ import annotations

import argparse
import hashlib
import threading
from collections.abc import Iterator
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from simulations.cli import add_simulate_command
from simulations.fetch import TRACES, FetchError, TraceFile, TraceSource, aggregate_servegen, fetch_traces
from tests.data import MOONCAKE, TRACES_DIR
from tests.integration.ports import free_ports

pytestmark = pytest.mark.integration

CLIENT_0 = b"0,1.5,1.0,Gamma,1,1\n600,0,0,,0,0\n1200,0.25,2.0,Weibull,1,1\n"
CLIENT_1 = b"0,2.0,4.0,Weibull,1,1\n600,0,0,,0,0\n1200,0,0,,0,0\n"
OTHER_MODEL = b"0,3.0,1.5,Gamma,1,1\n"
AGGREGATE = (
    b"category,model,window_start_s,total_rate_req_per_s,active_clients,rate_weighted_mean_iat_cv\r\n"
    # (1.5 x 1.0 + 2.0 x 4.0) / 3.5 = 2.7143; window 600: nobody sent anything, so no CV.
    b"language,m-test,0,3.5,2,2.7143\r\n"
    b"language,m-test,600,0.0,0,\r\n"
    b"language,m-test,1200,0.25,1,2.0\r\n"
    b"reason,r-test,0,3.0,1,1.5\r\n"
)


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def mirror(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """A directory served on 127.0.0.1, and its URL."""
    root = tmp_path / "mirror"
    root.mkdir()
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(_QuietHandler, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield root, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def put(root: Path, path: str, data: bytes) -> None:
    (root / path).parent.mkdir(parents=True, exist_ok=True)
    (root / path).write_bytes(data)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def small_sources(plain: bytes) -> list[TraceSource]:
    """Two traces shaped like the real ones: a file saved as it is, and a curve summed from per-client files."""
    return [
        TraceSource(
            name="plain",
            base_url="http://127.0.0.1:9/unused",
            files=(TraceFile("plain/trace.jsonl", sha256(plain), ("trace.jsonl",), len(plain)),),
            description="one file",
        ),
        TraceSource(
            name="curve",
            base_url="http://127.0.0.1:9/unused",
            files=(
                TraceFile(
                    "curve/rates.csv",
                    sha256(AGGREGATE),
                    (
                        "language/m-test/chunk-0-trace.csv",
                        "language/m-test/chunk-1-trace.csv",
                        "reason/r-test/chunk-0-trace.csv",
                    ),
                    len(CLIENT_0) + len(CLIENT_1) + len(OTHER_MODEL),
                    build=aggregate_servegen,
                ),
            ),
            description="summed per window",
        ),
    ]


def serve_small_sources(root: Path, plain: bytes) -> None:
    put(root, "plain/trace.jsonl", plain)
    put(root, "curve/language/m-test/chunk-0-trace.csv", CLIENT_0)
    put(root, "curve/language/m-test/chunk-1-trace.csv", CLIENT_1)
    put(root, "curve/reason/r-test/chunk-0-trace.csv", OTHER_MODEL)


def test_files_land_checked_and_present_ones_are_kept(mirror: tuple[Path, str], tmp_path: Path) -> None:
    root, url = mirror
    plain = MOONCAKE.read_bytes()
    serve_small_sources(root, plain)
    traces = tmp_path / "traces"
    lines: list[str] = []
    done = fetch_traces(traces, base_url=url, sources=small_sources(plain), progress=False, log=lines.append)
    assert done == [("plain/trace.jsonl", "downloaded"), ("curve/rates.csv", "downloaded")]
    assert (traces / "plain" / "trace.jsonl").read_bytes() == plain
    assert (traces / "curve" / "rates.csv").read_bytes() == AGGREGATE
    assert not list(traces.rglob("*.partial"))
    # A second run downloads nothing: the mirror may even be gone.
    (root / "plain" / "trace.jsonl").unlink()
    again = fetch_traces(
        traces, base_url=url, sources=small_sources(plain), only=["plain"], progress=False, log=lines.append
    )
    assert again == [("plain/trace.jsonl", "present")]
    # A file with another checksum is downloaded again.
    (traces / "curve" / "rates.csv").write_bytes(b"edited")
    assert fetch_traces(
        traces, base_url=url, sources=small_sources(plain), only=["curve"], progress=False, log=lines.append
    ) == [("curve/rates.csv", "downloaded")]
    assert (traces / "curve" / "rates.csv").read_bytes() == AGGREGATE
    assert "curve/rates.csv: present with another checksum, downloading it again" in lines


def test_a_wrong_checksum_leaves_nothing_and_names_both_sums(mirror: tuple[Path, str], tmp_path: Path) -> None:
    root, url = mirror
    plain = MOONCAKE.read_bytes()
    serve_small_sources(root, plain[:-10])  # a truncated copy
    traces = tmp_path / "traces"
    with pytest.raises(FetchError, match="was removed") as info:
        fetch_traces(traces, base_url=url, sources=small_sources(plain), only=["plain"], progress=False, log=print)
    assert sha256(plain) in str(info.value) and sha256(plain[:-10]) in str(info.value)
    assert not (traces / "plain" / "trace.jsonl").exists()
    assert not list(traces.rglob("*.partial"))


def test_http_and_network_errors_name_the_url_and_leave_nothing(mirror: tuple[Path, str], tmp_path: Path) -> None:
    _, url = mirror
    plain = MOONCAKE.read_bytes()
    traces = tmp_path / "traces"
    with pytest.raises(FetchError, match="HTTP 404") as info:  # the mirror serves nothing
        fetch_traces(traces, base_url=url, sources=small_sources(plain), only=["curve"], progress=False, log=print)
    assert f"{url}/curve/language/m-test/chunk-0-trace.csv" in str(info.value)
    closed = free_ports(1)
    with pytest.raises(FetchError, match=r"GET http://127\.0\.0\.1:") as info:  # nothing listens there
        fetch_traces(
            traces, base_url=f"http://127.0.0.1:{closed}", sources=small_sources(plain), progress=False, log=print
        )
    assert "SHOAL_TRACES_BASE_URL" in str(info.value)
    assert not [p for p in traces.rglob("*") if p.is_file()]
    with pytest.raises(FetchError, match="unknown trace 'nope'"):
        fetch_traces(traces, only=["nope"], progress=False, log=print)


def fetch_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="shoal")
    add_simulate_command(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["simulate", "fetch-traces", *argv])
    result: int = args.run(args)
    return result


def test_the_command_checks_the_published_checksums(
    mirror: tuple[Path, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    root, url = mirror
    # The slices of tests/data laid out as a mirror: the right names, but not the published files' bytes.
    (azure,) = (s for s in TRACES if s.name == "azure")
    for file in azure.files:
        put(root, f"azure/{Path(file.path).name}", (TRACES_DIR / file.path).read_bytes())
    traces = tmp_path / "traces"
    monkeypatch.delenv("SHOAL_TRACES_DIR", raising=False)
    monkeypatch.delenv("SHOAL_TRACES_BASE_URL", raising=False)
    assert fetch_cli(["--only", "azure"]) == 2
    assert "--traces-dir" in capsys.readouterr().err
    monkeypatch.setenv("SHOAL_TRACES_BASE_URL", url)
    assert fetch_cli(["--traces-dir", str(traces), "--only", "azure"]) == 1
    err = capsys.readouterr().err
    assert "AzureLLMInferenceTrace_code.csv: sha256" in err and azure.files[0].sha256 in err
    assert "was removed" in err
    assert "B/s" in err  # the progress bar: bytes and rate
    assert not list(traces.rglob("*.csv*"))
    # The flag wins over the environment; a URL where nothing listens is a network error, exit 1.
    closed = free_ports(1)
    assert fetch_cli(["--traces-dir", str(traces), "--base-url", f"http://127.0.0.1:{closed}", "--no-progress"]) == 1
    assert f"GET http://127.0.0.1:{closed}/mooncake/synthetic_trace.jsonl" in capsys.readouterr().err
