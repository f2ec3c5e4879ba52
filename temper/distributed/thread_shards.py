"""Shards of one call run at once on CPU threads, each with single-threaded ops.

A small model's ops (a [2048, 128] RMSNorm, attention over 128 tokens with 32-wide heads) are
too small for intra-op parallelism: split over two cores they run no faster, often slower,
than on one, since every op wakes and joins the other thread. Only its matmuls use both cores.
Splitting the data instead keeps every core busy for the whole step: each thread runs the
forward and backward of its own share of the datums with single-threaded ops (an independent
autograd graph; CPU backward runs on the thread that calls it), and the shards' gradients are
summed afterwards.

Determinism: the datums are split by position, each thread computes its shard's gradient
with `torch.autograd.grad` (never accumulating into `.grad` concurrently, whose order would
depend on timing), and the per-shard gradients are added in shard order. Results are therefore
the same on every run, and equal to the unsharded gradient up to float rounding.

Threads: `torch.set_num_threads` stores a process-wide default that threads read once, the
first time they run an op, and sets the calling thread's own OpenMP and MKL thread counts.
The workers set 1 for themselves while the caller waits, then the caller restores its value as
the default, so no other thread (the caller's, a sampler's) runs single-threaded because of
them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

from temper.api.threads import pin_thread_count

Item = TypeVar("Item")
Result = TypeVar("Result")


class ThreadShards:
    """`num_threads` persistent worker threads whose torch ops are single-threaded."""

    def __init__(self, num_threads: int) -> None:
        if num_threads < 2:
            raise ValueError(f"ThreadShards needs >= 2 threads, got {num_threads}")
        self.num_threads = num_threads
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="temper-shard")
        default_threads = torch.get_num_threads()
        # Every worker must start (and fix its own thread count) before the default is
        # restored: tasks that wait for each other occupy one worker each.
        started = threading.Barrier(num_threads + 1)
        for _ in range(num_threads):
            self._pool.submit(_become_single_threaded, started)
        started.wait()
        torch.set_num_threads(default_threads)

    def map(self, fn: Callable[[Item], Result], items: Sequence[Item]) -> list[Result]:
        """fn(item) for each item, concurrently; results in item order. Waits for all of them
        before raising the first failure, so no shard is still running after a failed call."""
        futures = [self._pool.submit(fn, item) for item in items]
        errors = [future.exception() for future in futures]
        for error in errors:
            if error is not None:
                raise error
        return [future.result() for future in futures]

    def run(self, fn: Callable[[], Result]) -> Result:
        """fn() on one worker, with its single-threaded ops; waits for the result."""
        return self._pool.submit(fn).result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _become_single_threaded(started: threading.Barrier) -> None:
    pin_thread_count(1)
    started.wait()


def split_by_tokens(lengths: Sequence[int], num_shards: int) -> list[range]:
    """Consecutive index ranges, at most `num_shards`, none empty, with token counts as even
    as a split at item boundaries allows (greedy on the running total)."""
    total = sum(lengths)
    shards, start, running = [], 0, 0
    for index, length in enumerate(lengths):
        running += length
        # Close a shard once it reaches its share of the total, leaving items for the rest.
        share = total * (len(shards) + 1) / num_shards
        remaining_shards = num_shards - len(shards) - 1
        if running >= share and remaining_shards > 0 and index + 1 < len(lengths):
            shards.append(range(start, index + 1))
            start = index + 1
    shards.append(range(start, len(lengths)))
    return shards


def sum_gradients(
    per_shard: Sequence[Sequence[torch.Tensor | None]],
) -> list[torch.Tensor | None]:
    """Per-parameter sum over shards, in shard order (None where no shard has a gradient)."""
    totals: list[torch.Tensor | None] = list(per_shard[0])
    for grads in per_shard[1:]:
        for index, grad in enumerate(grads):
            if grad is None:
                continue
            totals[index] = grad if totals[index] is None else totals[index] + grad
    return totals
