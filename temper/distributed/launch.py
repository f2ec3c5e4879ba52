"""Starting and joining a torchrun job: the process group from torchrun's environment, leaving
it, and starting torchrun for `temper train --nproc N` (one machine) or `temper train
--nnodes N --nproc-per-node M --rdzv-endpoint HOST:PORT` (the same command on each machine).

torchrun (`python -m torch.distributed.run`) starts one process per rank and sets RANK,
LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; with OMP_NUM_THREADS and OMP_WAIT_POLICY
(set for the ranks, see `torchrun_environment`) those are the only environment variables read
in Temper. The backend follows the device: NCCL with CUDA (each rank on GPU LOCAL_RANK), gloo
on CPU.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class RankInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device


def launched_by_torchrun() -> bool:
    return all(name in os.environ for name in TORCHRUN_VARIABLES)


def init_from_env(*, device_type: str | None = None, timeout_s: float | None = None) -> RankInfo:
    """Initialize the default process group from torchrun's variables; returns this rank.

    `device_type` 'cuda' or 'cpu' (default: 'cuda' when available). `timeout_s`: how long a
    collective of the default group (the trainer's gathers and reductions, a colocated
    generator's weight gathers) waits for a rank that stalls before it fails; None: torch's
    default (10 min on NCCL, 30 min on gloo). A rank that dies fails it at once.
    """
    missing = [name for name in TORCHRUN_VARIABLES if name not in os.environ]
    if missing:
        raise ValueError(
            f"not started by torchrun: environment variables {', '.join(missing)} are unset; "
            "run `torchrun --nproc-per-node N ...`"
        )
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    if device_type not in ("cuda", "cpu"):
        raise ValueError(f"device_type must be 'cuda' or 'cpu', got {device_type!r}")
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device(device_type, local_rank) if device_type == "cuda" else torch.device("cpu")
    timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
    if device_type == "cuda":
        torch.cuda.set_device(device)
        # device_id binds NCCL's communicators to this rank's GPU at once (no guessing from
        # the current device of whichever thread makes the first collective).
        dist.init_process_group(backend="nccl", device_id=device, timeout=timeout)
    else:
        dist.init_process_group(backend="gloo", timeout=timeout)
    return RankInfo(
        rank=dist.get_rank(),
        local_rank=local_rank,
        world_size=dist.get_world_size(),
        device=device,
    )


def shutdown() -> None:
    """Leave the process group. Drop every FSDP/DDP module first: one still alive when the
    group is destroyed crashes the process at exit (measured with gloo)."""
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def torchrun_command(
    *,
    nproc: int,
    args: Sequence[str],
    nnodes: int = 1,
    rdzv_endpoint: str | None = None,
    run_id: str = "temper",
) -> list[str]:
    """`python -m torch.distributed.run ... -m temper ARGS` (through `torchrun_main`, which
    ends quietly when stopped by a signal): N ranks on this machine, on a free
    port (`--standalone`), or this node's N ranks of `nnodes` that meet at `rdzv_endpoint`
    (torchrun's c10d rendezvous; every node runs the same command, `run_id` names the job)."""
    if nnodes == 1:
        where = ["--standalone"]
    else:
        assert rdzv_endpoint is not None, "several nodes meet at a rendezvous endpoint"
        where = [
            f"--nnodes={nnodes}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={rdzv_endpoint}",
            f"--rdzv-id={run_id}",
        ]
    return [
        sys.executable,
        "-m",
        "temper.distributed.torchrun_main",
        *where,
        f"--nproc-per-node={nproc}",
        "-m",
        "temper",
        *args,
    ]


def torchrun_environment(*, nproc: int, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The ranks' environment: OpenMP threads that do not spin (with several processes on few
    cores, spinning threads make small ops up to 190x slower, DESIGN.md 7) and the cores shared
    out among the ranks, unless the caller set either already."""
    env = dict(os.environ if environ is None else environ)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    return env


def run_under_torchrun(
    *,
    nproc: int,
    args: Sequence[str],
    nnodes: int = 1,
    rdzv_endpoint: str | None = None,
    run_id: str = "temper",
) -> int:
    """Run `temper ARGS` on `nproc` ranks of this machine (of `nnodes`, see
    `torchrun_command`); returns torchrun's exit code.

    torchrun runs in a session of its own, so a terminal's Ctrl-C reaches this process only
    (not every rank at once, each with its own KeyboardInterrupt traceback). SIGINT or SIGTERM
    here terminates torchrun, which stops its ranks; a second one kills the session. Then
    KeyboardInterrupt is raised here, once no rank is left. (`subprocess.run` would kill
    torchrun alone on Ctrl-C, and its ranks would train on to the end, orphaned.)"""
    command = torchrun_command(
        nproc=nproc, args=args, nnodes=nnodes, rdzv_endpoint=rdzv_endpoint, run_id=run_id
    )
    process = subprocess.Popen(
        command, env=torchrun_environment(nproc=nproc), start_new_session=True
    )
    signals: list[int] = []

    def stop(signum: int, frame: object) -> None:
        signals.append(signum)
        if len(signals) == 1:
            process.terminate()
        else:
            os.killpg(process.pid, signal.SIGKILL)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = process.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if signals:
        raise KeyboardInterrupt
    return code
