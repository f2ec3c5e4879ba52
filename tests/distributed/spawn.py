"""Run a function on N gloo ranks with torch.multiprocessing.spawn and collect its results.

Each rank initializes a gloo process group on a fresh local port, runs `fn(rank, *args)`,
saves the return value with torch.save, drops its modules (FSDP/DDP modules alive at
`destroy_process_group` crash the process at exit) and tears the group down. An exception on
any rank fails the caller with that rank's traceback.
"""

from __future__ import annotations

import gc
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def spawn(
    fn: Callable[..., Any],
    *,
    world_size: int,
    out_dir: Path,
    args: tuple = (),
    timeout_s: float = 300.0,
) -> list[Any]:
    """`fn(rank, *args)` on `world_size` ranks; returns each rank's result, by rank.

    A rank that hangs (a collective some rank never entered) fails the test after
    `timeout_s` instead of blocking the suite.
    """
    port = free_port()
    context = mp.spawn(
        _entry, args=(fn, world_size, port, out_dir, args), nprocs=world_size, join=False
    )
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise TimeoutError(f"{fn.__name__} on {world_size} ranks ran past {timeout_s} s")
    return [
        torch.load(out_dir / f"rank{rank}.pt", weights_only=False) for rank in range(world_size)
    ]


def _entry(rank: int, fn, world_size: int, port: int, out_dir: Path, args: tuple) -> None:
    torch.set_num_threads(1)  # several ranks share two cores
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    try:
        result = fn(rank, *args)
        torch.save(result, out_dir / f"rank{rank}.pt")
        del result
    finally:
        gc.collect()
        dist.destroy_process_group()
