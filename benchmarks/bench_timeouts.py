"""What a timeout costs a proxied request under uvloop: `asyncio.timeout` and `loop.call_later` against the router's
swept `Deadlines` (router/service/deadlines.py), for a 30-minute bound that never fires. Not a test: it prints
microseconds per use (run it under `taskset -c 0`).
"""

from __future__ import annotations

import argparse
import asyncio
import time

import uvloop

from router.service.deadlines import Deadlines


def _noop() -> None:
    pass


async def measure(num: int) -> dict[str, float]:
    loop = asyncio.get_running_loop()
    deadlines = Deadlines(loop)
    results: dict[str, float] = {}

    started = time.perf_counter()
    for _ in range(num):
        async with asyncio.timeout(1800):  # noqa: ASYNC100 - the cost of entering and leaving is the point
            pass
    results["asyncio.timeout: enter and exit"] = time.perf_counter() - started

    started = time.perf_counter()
    for _ in range(num):
        async with deadlines.timeout(1800):
            pass
    results["Deadlines.timeout: enter and exit"] = time.perf_counter() - started

    started = time.perf_counter()
    for _ in range(num):
        loop.call_later(1800, _noop).cancel()
    results["loop.call_later + cancel"] = time.perf_counter() - started

    started = time.perf_counter()
    for _ in range(num):
        deadlines.call_later(1800, _noop).cancel()
    results["Deadlines.call_later + cancel"] = time.perf_counter() - started
    return {name: seconds / num * 1e6 for name, seconds in results.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--uses", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    rounds = [uvloop.run(measure(args.uses)) for _ in range(args.rounds)]
    print(f"{'':36s}" + "".join(f"{f'round {i + 1}':>10s}" for i in range(args.rounds)) + "   (us per use)")
    for name in rounds[0]:
        print(f"{name:36s}" + "".join(f"{r[name]:10.2f}" for r in rounds))


if __name__ == "__main__":
    main()
