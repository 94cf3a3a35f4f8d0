"""Processes of a tensor-parallel replica: `shoal replica --tensor-parallel-size N` is rank 0 and starts N - 1 ranks.

Rank 0 serves HTTP and runs the engine (`replica.engine.parallel`); ranks 1..N-1 are `python -m replica.ranks`
children given the same settings (as JSON) and their rank. Each loads the checkpoint (and quantizes it, if asked),
keeps its shard, joins the group at a free loopback port and runs the steps rank 0 broadcasts until told to stop.

Lifetimes: a rank is started with `PR_SET_PDEATHSIG` (`router.common.child_processes`), so it ends when rank 0
ends, however rank 0 ends; it also ends with an error when rank 0's sockets close under a collective. Rank 0 waits
on every rank in a thread: a rank that exits before rank 0 asked it to stops the replica (SIGTERM to itself: the
server's graceful shutdown, in-flight requests fail so the router fails over), with a clear error and a nonzero
exit code, and a hard exit after `_EXIT_GRACE_S` if shutdown itself hangs on the broken group.

Threads: `--threads` is per rank (each rank runs a full forward over its shard); without it each rank takes
cores / N, so the ranks together use the machine's cores and do not oversubscribe them. With `cpus` each rank
runs on its own equal share of those cores, a thread per core.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import threading
from typing import TYPE_CHECKING

from replica.settings import ReplicaSettings
from router.common.child_processes import start_child
from router.common.heap import freeze_loaded
from router.common.ports import free_port

if TYPE_CHECKING:
    from replica.engine.parallel import TensorParallel
    from replica.model.model import MoEForCausalLM

log = logging.getLogger(__name__)

_EXIT_GRACE_S = 10.0
"""Seconds rank 0 gives its graceful shutdown after losing a rank before it exits outright."""
_STOP_WAIT_S = 10.0
"""Seconds rank 0 waits for the other ranks to exit after telling them to stop, before it kills them."""


def rank_device(device: str, rank: int) -> str:
    """The device of `rank`: `cuda` or `cuda:k` -> the (k +) rank-th GPU; any other device as it is."""
    if device == "cuda" or device.startswith("cuda:"):
        base = int(device.partition(":")[2] or 0)
        return f"cuda:{base + rank}"
    return device


def threads_per_rank(threads: int | None, world_size: int) -> int:
    return threads if threads else max(1, (os.cpu_count() or 1) // world_size)


def _check_shardable(settings: ReplicaSettings) -> None:
    from replica.loading import checkpoint_dir
    from replica.model.config import ModelConfig
    from replica.model.shard import check_shardable

    config = ModelConfig.from_file(checkpoint_dir(settings) / "config.json")
    check_shardable(config, settings.tensor_parallel_size, is_nvfp4=settings.quantization != "none")


class RankGroup:
    """Rank 0's view of the other ranks: their processes, and the group once `join` formed it."""

    def __init__(self, settings: ReplicaSettings, *, threads: int) -> None:
        self.settings = settings
        self.world_size = settings.tensor_parallel_size
        self.threads = threads
        self.master_port = free_port()
        self.processes: list[subprocess.Popen[bytes]] = []
        self.group: TensorParallel | None = None
        self.lost_rank: int | None = None
        self._stopping = False

    @classmethod
    def start(cls, settings: ReplicaSettings, *, threads: int | None) -> RankGroup:
        """Check the model divides over the ranks, then start ranks 1..N-1 and watch them."""
        _check_shardable(settings)
        ranks = cls(settings, threads=threads_per_rank(threads, settings.tensor_parallel_size))
        payload = settings.model_dump_json(exclude={"config_file"})
        for rank in range(1, ranks.world_size):
            command = [
                sys.executable,
                "-m",
                "replica.ranks",
                f"--rank={rank}",
                f"--master-port={ranks.master_port}",
                f"--threads={ranks.threads}",
                f"--settings={payload}",
            ]
            process = start_child(command)
            ranks.processes.append(process)
            log.info("tensor-parallel rank %d started, pid %d", rank, process.pid)
            threading.Thread(target=ranks._watch, args=(rank, process), daemon=True, name=f"shoal-rank-{rank}").start()
        return ranks

    def join(self, model: MoEForCausalLM) -> None:
        """Form the group (waits for every rank, up to the timeout) and keep rank 0's shard of `model`."""
        from replica.engine.parallel import TensorParallel, initial_capacity
        from replica.model.shard import shard_model

        s = self.settings
        self.group = TensorParallel.join(
            rank=0,
            world_size=self.world_size,
            master_port=self.master_port,
            device=model.device,
            timeout_s=s.tensor_parallel_timeout_s,
            capacity=initial_capacity(s.max_num_batched_tokens, s.max_num_seqs),
        )
        shard_model(model, self.group)
        log.info("tensor parallelism over %d ranks, %d threads each", self.world_size, self.threads)

    def _watch(self, rank: int, process: subprocess.Popen[bytes]) -> None:
        code = process.wait()
        if self._stopping:
            return
        self.lost_rank = rank
        message = (
            f"shoal replica: tensor-parallel rank {rank} (pid {process.pid}) exited with code {code}; "
            "the replica cannot serve without it and exits"
        )
        log.error("%s", message)
        print(message, file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)  # the server's graceful shutdown, as on Ctrl-C
        if not threading.Event().wait(_EXIT_GRACE_S):
            os._exit(1)  # shutdown is stuck on the broken group; the exit code still says why

    def stop(self) -> int:
        """Stop the other ranks (told to, if all are alive; else terminated) -> 1 if one was lost, else 0."""
        self._stopping = True
        if self.group is not None and self.lost_rank is None:
            try:
                self.group.send_stop()
            except RuntimeError as exc:
                log.warning("could not tell the other ranks to stop: %s", exc)
        for process in self.processes:
            if self.lost_rank is not None:
                process.terminate()
            try:
                process.wait(timeout=_STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self.group is not None:
            self.group.close()
        return 1 if self.lost_rank is not None else 0


def run_rank(settings: ReplicaSettings, *, rank: int, master_port: int, threads: int) -> int:
    """A rank other than 0: load, shard, join, follow rank 0's steps until it says stop."""
    import torch

    from replica.engine.parallel import TensorParallel, TensorParallelError, initial_capacity
    from replica.engine.runner import ModelRunner, follow_steps
    from replica.loading import load_for_serving
    from replica.model.shard import shard_model

    torch.set_num_threads(threads)
    settings = settings.model_copy(update={"device": rank_device(settings.device, rank)})
    model, _ = load_for_serving(settings)
    assert isinstance(model, torch.nn.Module)
    try:
        group = TensorParallel.join(
            rank=rank,
            world_size=settings.tensor_parallel_size,
            master_port=master_port,
            device=torch.device(settings.device),
            timeout_s=settings.tensor_parallel_timeout_s,
            capacity=initial_capacity(settings.max_num_batched_tokens, settings.max_num_seqs),
        )
    except TensorParallelError as exc:
        print(f"shoal replica: {exc}", file=sys.stderr)
        return 1
    shard_model(model, group)  # type: ignore[arg-type]
    runner = ModelRunner(model, num_blocks=settings.num_blocks, block_size=settings.block_size)  # type: ignore[arg-type]
    freeze_loaded()  # a full pass in one rank would hold the group's steps, rank 0 waiting in the all-reduce
    try:
        num_steps = follow_steps(runner, group)
    except RuntimeError as exc:  # a collective failed: rank 0 or another rank is gone
        print(f"shoal replica: tensor-parallel rank {rank} lost the group: {exc}", file=sys.stderr)
        return 1
    group.close()
    log.info("tensor-parallel rank %d stopped after %d steps", rank, num_steps)
    return 0


def main(argv: list[str] | None = None) -> int:
    from replica.loading import own_cores, sleeping_omp_threads

    parser = argparse.ArgumentParser(prog="python -m replica.ranks", description="a tensor-parallel rank > 0")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--master-port", type=int, required=True)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--settings", required=True, help="ReplicaSettings as JSON")
    args = parser.parse_args(argv)
    settings = ReplicaSettings(**json.loads(args.settings))
    cores = settings.rank_cores(args.rank)  # rank 0 checked the whole list
    if cores is None:
        sleeping_omp_threads()
    else:
        own_cores(cores)
    log_format = f"%(asctime)s %(levelname)s rank{args.rank} %(message)s"
    logging.basicConfig(level=settings.log_level.upper(), format=log_format)
    return run_rank(settings, rank=args.rank, master_port=args.master_port, threads=args.threads)


if __name__ == "__main__":
    raise SystemExit(main())
