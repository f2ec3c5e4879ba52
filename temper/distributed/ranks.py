"""The ranks of an SPMD job as a training loop sees them: who am I, my share, add it all up.

A loop (RL, SFT warm-up) runs the same program on every rank. It needs a few things besides
the trainer's own collectives: which share of a step's data is this rank's, the sum or the
maximum of per-rank numbers (metrics, token counts), and one writer (rank 0) for files, whose
success or failure every rank learns. `Ranks.single()` is the one-process case: every share is
everything and every reduction is the identity, so a loop has one code path.

The loop's collectives run on a gloo group of their own (Python objects and CPU tensors, with
any trainer backend), separate from the trainer's groups. The loop calls them from its main
thread while the training client's worker is idle (every loop waits for each training call),
so they never interleave with the trainer's collectives.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from temper.distributed.world import trainer_world

T = TypeVar("T")


@dataclass(frozen=True)
class Ranks:
    rank: int
    world_size: int
    group: Any = None
    """The loop's gloo process group; None in one process."""

    @classmethod
    def single(cls) -> Ranks:
        return cls(rank=0, world_size=1)

    @classmethod
    def current(cls) -> Ranks:
        """This job's ranks: the trainer's world (world.py) with a gloo group of their own
        (collective: every rank of the world calls it, unless a placement made the group
        already), or one process when torch.distributed is not initialized."""
        if not (dist.is_available() and dist.is_initialized()):
            return cls.single()
        world = trainer_world()
        group = world.loop_group if world.loop_group is not None else dist.new_group(backend="gloo")
        return cls(rank=world.rank, world_size=world.size, group=group)

    @classmethod
    def of_trainer(cls) -> Ranks:
        """The trainer's ranks on the trainer's own process group (for a one-off agreement
        outside a loop, e.g. naming a run)."""
        world = trainer_world()
        return cls(rank=world.rank, world_size=world.size, group=world.group)

    @classmethod
    def of_default_group(cls) -> Ranks:
        """Every rank of the initialized default process group (e.g. before a placement
        splits them into roles)."""
        return cls(rank=dist.get_rank(), world_size=dist.get_world_size())

    @staticmethod
    def world_size_now() -> int:
        """Ranks of the whole torch.distributed world (1 when it is not initialized)."""
        if not (dist.is_available() and dist.is_initialized()):
            return 1
        return dist.get_world_size()

    @property
    def is_writer(self) -> bool:
        """Rank 0 writes the job's files (logs, metrics, checkpoints' bookkeeping)."""
        return self.rank == 0

    def share(self, count: int, *, field: str) -> slice:
        """This rank's equal, contiguous share of `count` items; `count` must divide evenly
        (`field` names the setting in the error)."""
        if count % self.world_size:
            raise ValueError(
                f"{field}={count} must be divisible by the number of ranks ({self.world_size}): "
                f"every rank takes an equal share; use a multiple of {self.world_size}"
            )
        size = count // self.world_size
        return slice(self.rank * size, (self.rank + 1) * size)

    def split(self, count: int) -> slice:
        """This rank's contiguous part of `count` items, as even as possible (may be empty)."""
        base, extra = divmod(count, self.world_size)
        start = self.rank * base + min(self.rank, extra)
        return slice(start, start + base + (1 if self.rank < extra else 0))

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sums over ranks (float64)."""
        if self.world_size == 1:
            return list(values)
        total = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(total, group=self.group)
        return total.tolist()

    def all_gather(self, value: T) -> list[T]:
        """Every rank's `value` (picklable), by rank."""
        if self.world_size == 1:
            return [value]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, value, group=self.group)
        return gathered

    def broadcast(self, value: T) -> T:
        """Rank 0's `value` on every rank."""
        if self.world_size == 1:
            return value
        message = [value]
        dist.broadcast_object_list(message, group=self.group, group_src=0)
        return message[0]

    def on_writer(self, fn: Callable[[], T]) -> T:
        """Run `fn` on rank 0 only; every rank returns its result or raises its error.

        The other ranks wait for rank 0, so on return the file `fn` wrote exists for all."""
        if self.world_size == 1:
            return fn()
        result: Any = None
        error: BaseException | None = None
        if self.is_writer:
            try:
                result = fn()
            except Exception as caught:
                error = caught
        message = self.broadcast([result, picklable_error(error, label="rank 0: ")])
        if error is not None:
            raise error
        if message[1] is not None:
            raise message[1]
        return message[0]

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)


def picklable_error(error: BaseException | None, *, label: str = "") -> BaseException | None:
    """The error itself if it survives pickling (to send it to other ranks), else a
    RuntimeError with `label`, its type and its message."""
    if error is None:
        return None
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        return RuntimeError(f"{label}{type(error).__name__}: {error}")
    return error
