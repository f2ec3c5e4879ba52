"""Faults injected into a disaggregated RL job's weight sync, on gloo ranks (the deadline tests).

A generator rank dies (`os._exit`, as if killed: no goodbye on any connection) or stalls (a
sleep of `stall_s`) when it receives its Nth data broadcast of the sync of `FAULT_VERSION`,
and writes the wall-clock time of the fault to a file first, with the ids of the processes
it started (vLLM's engine process and workers) when asked. Every rank records when and how
it ended. `run_until_failure` starts the ranks and, once every trainer rank has ended and the
generator rank had `generator_grace_s` to end too, stops the ranks still alive, as torchrun
does once one rank of its job fails.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from temper.distributed import weight_transfer
from temper.generator import generator_rank
from temper.rl.job import RLJob
from tests.distributed.rl_runs import skip_plots
from tests.distributed.spawn import free_port, rank_processes

FAULT_VERSION = 3
"""The sync after the first checkpoint (the warm-up's 2 steps and RL step 0)."""
FAULT_AT_BROADCAST = 3
"""The data broadcast of that sync (counted on the generator rank) at which the fault comes."""


def arm_fault(
    *, kind: str, record: Path, stall_s: float = 600.0, record_children: bool = False
) -> None:
    """On this generator rank: die or stall in the middle of the sync of FAULT_VERSION.
    `record_children`: the record names the processes this rank started (psutil)."""
    receive, broadcast = generator_rank.GeneratorRank._receive, weight_transfer._all
    state = {"armed": False, "count": 0}

    def receiving(self, version: int) -> None:
        state["armed"] = version == FAULT_VERSION
        receive(self, version)

    def faulty_broadcast(tensors, **kwargs) -> None:
        if state["armed"]:
            state["count"] += 1
            if state["count"] == FAULT_AT_BROADCAST:
                fault = {"time": time.time(), "kind": kind}
                if record_children:
                    fault["children"] = _descendants()
                record.write_text(json.dumps(fault))
                if kind == "kill":
                    os._exit(17)
                time.sleep(stall_s)
        broadcast(tensors, **kwargs)

    generator_rank.GeneratorRank._receive = receiving
    weight_transfer._all = faulty_broadcast


def _descendants() -> list[int]:
    import psutil

    return [child.pid for child in psutil.Process().children(recursive=True)]


def faulty_rank(
    rank: int,
    config: RLJob.Config,
    run_dir: Path,
    out: Path,
    kind: str,
    stall_s: float,
    record_children: bool,
) -> dict:
    """The job on this rank; the generator rank (the last) with a fault armed. Returns how
    it ended: the error's message and when."""
    skip_plots()
    if rank + 1 == _world_size():  # the generator rank
        arm_fault(
            kind=kind, record=out / "fault.json", stall_s=stall_s, record_children=record_children
        )
    try:
        RLJob(config).run(run_dir=run_dir)
    except RuntimeError as error:
        return {"time": time.time(), "error": str(error), "type": type(error).__name__}
    return {"time": time.time(), "error": None}


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size()


def run_until_failure(
    config: RLJob.Config,
    *,
    run_dir: Path,
    out: Path,
    kind: str,
    world_size: int = 3,
    stall_s: float = 600.0,
    generator_grace_s: float = 0.0,
    record_children: bool = False,
) -> dict:
    """The job on `world_size` gloo ranks with a fault on the last (its one generator rank);
    once every trainer rank has ended (at most 240 s) and the generator rank had
    `generator_grace_s` more, the ranks still alive are stopped (torchrun's part). Returns the
    fault's record (None: the job ended before the fault; with the generator rank's child
    processes: `record_children`), each rank's result (None: it left none), and the generator's
    exit code."""
    args = (config, run_dir, out, kind, stall_s, record_children)
    processes = rank_processes(
        faulty_rank, world_size=world_size, port=free_port(), out_dir=out, args=args
    )
    for process in processes:
        process.start()
    deadline = time.monotonic() + 240
    for process in processes[:-1]:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
    trainers_alive = [process.is_alive() for process in processes[:-1]]
    processes[-1].join(timeout=generator_grace_s)
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join()
    import torch

    results = [
        torch.load(out / f"rank{rank}.pt", weights_only=False)
        if (out / f"rank{rank}.pt").exists()
        else None
        for rank in range(world_size)
    ]
    return {
        "fault": json.loads(fault.read_text()) if (fault := out / "fault.json").exists() else None,
        "trainers": results[:-1],
        "generator": results[-1],
        "trainers_alive": trainers_alive,
        "generator_exit": processes[-1].exitcode,
    }
