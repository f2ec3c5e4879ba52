"""A CPU decode step split into consecutive row groups that run at once, one thread each.

Shapes: B rows of a decode step.

A small model's decode step is a few hundred small ops (RMSNorm, RoPE, attention over one
query per row, sampling) around a few matmuls. Intra-op threads do not pay off at that size:
every op wakes and joins the other threads, and a two-thread step runs slower than a one-thread
one. Splitting the rows instead gives each core a whole forward of its own: shard i runs the
model over its rows (their KV-cache slots only), the logits, and the sampling of its rows,
with single-threaded ops on a `ThreadShards` worker (see temper/distributed/thread_shards.py).

Every op of a decode step is row-wise (a row's matmul output, attention over its own slot,
its own sampling draw), and all shards attend over the same cache width as the whole step
would, so a row's token and logprobs are bitwise those of the unsplit step on one thread, however
the step is split (checked in tests/sampler/cpu/test_decode_shards.py), with one exception that
the split avoids: CPU fp32 GEMM (torch 2.13, MKL) rounds a product of 1-3 rows differently
from the same rows inside a product of 4 or more (another kernel); from 4 rows on, a row's
bits do not depend on how many rows share the product or where they start (bf16 and
oneDNN-packed weights: at any size). So no shard has fewer than `MIN_SHARD_ROWS` rows. (An
unsplit step on several intra-op threads is not bitwise the one-thread step either way: its
GEMM hands each thread a block of rows, and a block of 1-3 rows rounds differently.) A MoE
layer is the other exception, which no split avoids: it multiplies each expert's rows of the
step at once, and in fp32 an expert can get 1-3 rows in a shard and more in the whole step,
so a fp32 MoE model's logprobs agree with the unsplit step to float rounding (tokens equal in
the tests); in bf16 they are bitwise again.

Python runs one thread at a time (the GIL), and each shard issues every op of the forward, so
a split step pays the per-op Python and dispatch cost once per shard, plus a GIL hand-over
around every op; only the kernels run concurrently. On this project's shared 2-core VM a split
step was slower than an unsplit one-thread step at every batch measured (docs/benchmarks.md),
so the engine does not split unless asked (`decode_shards`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, TypeVar

import torch

from temper.distributed.thread_shards import ThreadShards

Result = TypeVar("Result")

MIN_SHARD_ROWS = 4
"""Fewest rows in a shard: fp32 matmuls of 1-3 rows round differently (see above)."""


class DecodeShards:
    """Plans how a decode step's rows split, and runs the shards on persistent workers."""

    def __init__(self, *, setting: int | Literal["auto"], min_rows: int) -> None:
        self.setting = setting
        self.min_rows = min_rows
        self._workers: ThreadShards | None = None

    def plan(self, num_rows: int) -> list[range]:
        """Consecutive row ranges, as even as possible; one range means: do not split.

        'auto' splits into as many shards as torch has threads now (the generate call's
        thread count), each with at least `min_rows` rows; an int splits into that many.
        Either way no shard gets fewer than `MIN_SHARD_ROWS` rows.
        """
        if self.setting == "auto":
            num_shards = torch.get_num_threads()
            num_shards = min(num_shards, num_rows // max(self.min_rows, MIN_SHARD_ROWS))
        else:
            num_shards = min(self.setting, num_rows // MIN_SHARD_ROWS)
        return even_ranges(num_rows, max(num_shards, 1))

    def map(self, fn: Callable[[range], Result], shards: list[range]) -> list[Result]:
        """fn(rows) for every shard, concurrently, under inference mode (grad mode is per
        thread, so the workers set it themselves); results in shard order."""
        if len(shards) == 1:
            return [fn(shards[0])]
        if self._workers is None or self._workers.num_threads < len(shards):
            self.close()
            self._workers = ThreadShards(len(shards))

        def run(rows: range) -> Result:
            with torch.inference_mode():
                return fn(rows)

        return self._workers.map(run, shards)

    def close(self) -> None:
        if self._workers is not None:
            self._workers.close()
            self._workers = None


def even_ranges(num_rows: int, num_shards: int) -> list[range]:
    """`num_shards` consecutive, non-empty ranges covering 0..num_rows-1, sizes within one
    of each other (the larger ones first)."""
    if not 1 <= num_shards <= max(num_rows, 1):
        raise ValueError(f"num_shards must be in 1..{max(num_rows, 1)}, got {num_shards}")
    size, extra = divmod(num_rows, num_shards)
    ranges, start = [], 0
    for index in range(num_shards):
        stop = start + size + (index < extra)
        ranges.append(range(start, stop))
        start = stop
    return ranges
