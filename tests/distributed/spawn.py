"""Run a function on N gloo ranks, each a process of its own, and collect its results.

The ranks start from a fork server (`forkserver`) that imported torch and Temper once per test
process: each rank is a fresh process, as with `spawn`, without paying those imports again
(seconds a rank on the 2-core CI machine). A rank takes this process's environment variables
and working directory as they are when it starts, as a spawned one would.

Each rank initializes a gloo process group on a fresh local port, runs `fn(rank, *args)`,
saves the return value with torch.save, drops its modules (FSDP/DDP modules alive at
`destroy_process_group` crash the process at exit) and tears the group down. An exception on
any rank fails the caller with that rank's traceback.
"""

from __future__ import annotations

import gc
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PRELOAD = ("torch", "torch.distributed", "temper.rl.job", "temper.sft.job", __name__)
"""What the fork server imports once: torch and what most ranks run (RL and SFT jobs)."""


def rank_context():
    """The multiprocessing context ranks start from: the fork server, preloaded (PRELOAD)."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOAD))
    return context


def rank_processes(
    fn: Callable[..., Any], *, world_size: int, port: int, out_dir: Path, args: tuple = ()
) -> list:
    """Unstarted processes running `fn(rank, *args)` on `world_size` gloo ranks (`_entry`)."""
    context = rank_context()
    here = (dict(os.environ), os.getcwd())
    return [
        context.Process(target=_entry_here, args=(rank, *here, fn, world_size, port, out_dir, args))
        for rank in range(world_size)
    ]


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
    rank_context()
    here = (dict(os.environ), os.getcwd())
    context = mp.start_processes(
        _entry_here,
        args=(*here, fn, world_size, port, out_dir, args),
        nprocs=world_size,
        join=False,
        start_method="forkserver",
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


def _entry_here(rank: int, environ: dict, cwd: str, *entry_args) -> None:
    """`_entry` with the starting process's environment and working directory (a rank forked
    from the fork server has the server's)."""
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    _entry(rank, *entry_args)


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
