"""preStop hook of a replica pod: let in-flight requests finish before the engine gets SIGTERM.

Kubernetes runs this before it signals the container. First it waits `--delay-s`, while the routers see the
endpoint turn terminating and stop sending it new requests; then it polls the engine's own /metrics until no
request is running or waiting, or `--timeout-s` has passed (the router's limit on a whole request, so nothing
it still waits for is cut off). Engines: vLLM and Shoal's replica (`vllm:num_requests_*`), SGLang
(`sglang:num_running_reqs`, `sglang:num_queue_reqs`). An engine that refuses connections has exited; one too
slow to answer is busy.
Standard library only: it runs inside the stock vLLM and SGLang images as well as Shoal's.
"""

from __future__ import annotations

import argparse
import sys
import time
import urllib.error
import urllib.request

BUSY_METRICS = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "sglang:num_running_reqs",
    "sglang:num_queue_reqs",
)


def busy_requests(metrics_text: str) -> float:
    """Sum of every sample of the busy gauges (one per engine core or data-parallel rank)."""
    total = 0.0
    for line in metrics_text.splitlines():
        if not line or line.startswith("#"):
            continue
        # `name{labels} value [timestamp]` or `name value [timestamp]`
        if "{" in line:
            name, _, rest = line.partition("{")
            rest = rest.rpartition("}")[2]
        else:
            name, _, rest = line.partition(" ")
        if name.strip() in BUSY_METRICS:
            total += float(rest.split()[0])
    return total


class EngineBusy(Exception):
    """The engine did not answer in time: it is alive and loaded, so keep waiting."""


def scrape(url: str, timeout_s: float) -> str | None:
    """The metrics text; None when nothing listens any more (the engine has exited)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.read().decode("utf-8", "replace")
    except TimeoutError as exc:
        raise EngineBusy from exc
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, TimeoutError):
            raise EngineBusy from exc
        return None
    except OSError:
        return None


def drain(url: str, *, delay_s: float, timeout_s: float, interval_s: float, scrape_timeout_s: float = 5.0) -> str:
    """-> why it stopped waiting: `idle`, `unreachable` or `timeout`."""
    time.sleep(delay_s)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            text = scrape(url, scrape_timeout_s)
        except EngineBusy:
            text = ""
        if text is None:
            return "unreachable"
        if text and busy_requests(text) == 0:
            return "idle"
        if time.monotonic() >= deadline:
            return "timeout"
        time.sleep(interval_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--port", type=int, required=True, help="the engine's HTTP port")
    parser.add_argument("--path", default="/metrics")
    parser.add_argument("--delay-s", type=float, default=10.0, help="seconds to wait before polling")
    parser.add_argument("--timeout-s", type=float, required=True, help="seconds to wait for in-flight requests")
    parser.add_argument("--interval-s", type=float, default=1.0, help="seconds between polls")
    parser.add_argument("--scrape-timeout-s", type=float, default=5.0, help="seconds to wait for /metrics")
    args = parser.parse_args(argv)
    started = time.monotonic()
    reason = drain(
        f"http://127.0.0.1:{args.port}{args.path}",
        delay_s=args.delay_s,
        timeout_s=args.timeout_s,
        interval_s=args.interval_s,
        scrape_timeout_s=args.scrape_timeout_s,
    )
    print(f"drain: {reason} after {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
