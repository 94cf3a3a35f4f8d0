"""Tensor-parallel ranks that cannot disagree: rank 0 decides, the others only run the layers they hold.

Rank 0 runs the whole engine: scheduler, block manager, drafter, grammar matchers and `decide`. The other ranks hold
no sequence state at all, only their shard of the weights and their heads' paged KV cache. Each step rank 0
broadcasts one message, a `StepPlan`: the token ids to run (the tokens it decided last step and the drafts to
verify), their positions and cache slots, the block tables. Every rank then runs the same forward pass over its
shard, summing partial outputs with an all-reduce twice per layer; rank 0 alone computes logits and decides. What
the ranks would have to agree on (which tokens were accepted, how far a grammar advanced, which cache slots hold
what) exists only on rank 0 and reaches the others as the next step's inputs, so a rank whose floating-point results
differ can still never run another sequence than rank 0's, nor stall it: every rank issues the same collectives in
the same order, fixed by the plan's shape alone.

Each step is one broadcast, on a gloo group on the host (the plan is host data even when the all-reduces run on
NCCL): a buffer of int64 of an agreed capacity whose header says what follows. A plan larger than the capacity is
preceded by a resize message (both sides grow the buffer), so the usual step costs exactly one collective. The
step group waits without a deadline, as workers idle between requests; the all-reduce group times out after
`timeout_s`, so a rank that hangs mid-step fails the step instead of stalling it forever. A dead rank closes its
sockets, which fails the peers' next collective at once.

The all-reduce sums each element once and hands every rank the same result (gloo's and NCCL's ring algorithms
reduce each chunk on one rank and copy it to the others; with two ranks a + b = b + a exactly anyway), so the
residual stream, and with it each layer's router gate input, is bitwise identical on every rank: the ranks pick
the same experts without rank 0 having to broadcast its routing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta

import torch

_STEP, _STOP, _RESIZE = 1, 2, 3
_HEADER = 6  # kind, T, B, W (block-table width), R (sampled rows), capacity (resize only)
_IDLE_TIMEOUT = timedelta(days=30)
"""Deadline of the step broadcast: workers wait in it while rank 0 has nothing to run."""


class TensorParallelError(RuntimeError):
    """The tensor-parallel group cannot be formed or has lost a rank."""


@dataclass(frozen=True)
class StepPlan:
    """What every rank runs in one step, in row order (`ModelRunner` builds it on rank 0)."""

    input_ids: list[int]
    """[T] token ids."""
    positions: list[int]
    """[T]."""
    slots: list[int]
    """[T] cache slot of each token."""
    query_lens: list[int]
    """[B] new tokens of each sequence."""
    context_lens: list[int]
    """[B] cached + new tokens of each sequence."""
    block_tables: list[list[int]]
    """[B, W] block tables, padded with 0 to one width W."""
    sample_rows: list[int]
    """[R] rows whose logits rank 0 samples (increasing)."""

    def pack(self) -> list[int]:
        """The message: header, then each field flattened."""
        width = len(self.block_tables[0]) if self.block_tables else 0
        header = [_STEP, len(self.input_ids), len(self.query_lens), width, len(self.sample_rows), 0]
        flat_tables = [b for table in self.block_tables for b in table]
        return [
            *header,
            *self.input_ids,
            *self.positions,
            *self.slots,
            *self.query_lens,
            *self.context_lens,
            *flat_tables,
            *self.sample_rows,
        ]

    @classmethod
    def unpack(cls, message: list[int]) -> StepPlan:
        _, t, b, w, r, _ = message[:_HEADER]
        fields = []
        at = _HEADER
        for size in (t, t, t, b, b, b * w, r):
            fields.append(message[at : at + size])
            at += size
        ids, positions, slots, query_lens, context_lens, flat_tables, sample_rows = fields
        tables = [flat_tables[i * w : (i + 1) * w] for i in range(b)]
        return cls(ids, positions, slots, query_lens, context_lens, tables, sample_rows)


def initial_capacity(max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """Ints of the step buffer both sides start with: room for a full step of short contexts (64 blocks each)."""
    return _HEADER + 4 * max_num_batched_tokens + max_num_seqs * (2 + 64)


@dataclass
class CommStats:
    """Seconds this rank spent in collectives (host clock around each call: exact on the CPU; on CUDA an NCCL call
    returns once queued, so it times the launch only)."""

    all_reduce_s: float = 0.0
    num_all_reduces: int = 0
    step_message_s: float = 0.0
    num_step_messages: int = 0


class TensorParallel:
    """This process's place in a group of `world_size` ranks on one host (`join` forms it)."""

    def __init__(self, rank: int, world_size: int, *, step_group: object, capacity: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self._step_group = step_group
        self._buffer = torch.zeros(capacity, dtype=torch.long)
        self.stats = CommStats()

    @classmethod
    def join(
        cls,
        *,
        rank: int,
        world_size: int,
        master_port: int,
        device: torch.device,
        timeout_s: float,
        capacity: int,
    ) -> TensorParallel:
        """Rendezvous with the other ranks at 127.0.0.1:`master_port` (rank 0 listens there): NCCL for the
        all-reduces on CUDA, gloo otherwise; a host gloo group for the step messages."""
        import torch.distributed as dist

        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        try:
            dist.init_process_group(
                backend,
                init_method=f"tcp://127.0.0.1:{master_port}",
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=timeout_s),
            )
            step_group = dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT)
        except (RuntimeError, ValueError) as exc:  # DistStoreError and DistNetworkError are RuntimeErrors
            raise TensorParallelError(
                f"rank {rank} of {world_size} could not join the tensor-parallel group on 127.0.0.1:{master_port} "
                f"within {timeout_s:g} s: {exc}"
            ) from exc
        return cls(rank, world_size, step_group=step_group, capacity=capacity)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` (contiguous) over the ranks in place; returns it."""
        import torch.distributed as dist

        started = time.perf_counter()
        dist.all_reduce(x)
        self.stats.all_reduce_s += time.perf_counter() - started
        self.stats.num_all_reduces += 1
        return x

    def _broadcast(self) -> None:
        import torch.distributed as dist

        started = time.perf_counter()
        dist.broadcast(self._buffer, src=0, group=self._step_group)  # type: ignore[arg-type]
        self.stats.step_message_s += time.perf_counter() - started
        self.stats.num_step_messages += 1

    def _send(self, message: list[int]) -> None:
        if len(message) > self._buffer.numel():
            capacity = max(len(message), 2 * self._buffer.numel())
            self._buffer[:_HEADER] = torch.tensor([_RESIZE, 0, 0, 0, 0, capacity])
            self._broadcast()
            self._buffer = torch.zeros(capacity, dtype=torch.long)
        self._buffer[: len(message)] = torch.tensor(message, dtype=torch.long)
        self._broadcast()

    def send_step(self, plan: StepPlan) -> None:
        """Rank 0: broadcast the step every rank runs next."""
        assert self.rank == 0
        self._send(plan.pack())

    def send_stop(self) -> None:
        """Rank 0: tell the other ranks to return from `receive_step` with None."""
        assert self.rank == 0
        self._send([_STOP, 0, 0, 0, 0, 0])

    def receive_step(self) -> StepPlan | None:
        """Other ranks: the next step rank 0 broadcasts; None once it says stop."""
        assert self.rank != 0
        while True:
            self._broadcast()
            header = self._buffer[:_HEADER].tolist()
            if header[0] == _RESIZE:
                self._buffer = torch.zeros(header[5], dtype=torch.long)
                continue
            if header[0] == _STOP:
                return None
            if header[0] != _STEP:
                raise TensorParallelError(f"rank {self.rank}: unknown step message kind {header[0]}")
            _, t, b, w, r, _ = header
            return StepPlan.unpack(self._buffer[: _HEADER + 3 * t + 2 * b + b * w + r].tolist())

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
