"""`temper serve --nproc N --placement.mode disaggregated --placement.generator_ranks G`.

The command starts the ranks itself: the N - G trainer ranks under torchrun (a trainer rank
that dies ends every trainer rank, as with any FSDP job) and each of the G generator ranks as
a plain process of its own, outside torchrun, so that a generator rank that dies leaves the
others and the server serving. Rank 0 listens on a loopback port the command chooses; each
generator rank connects to it (authenticated by a key the command draws) and says which one it
is. These variables carry that to the ranks (set by the command, read here only):

- TEMPER_GENERATORS_ADDRESS: host:port rank 0 listens on for the generator ranks.
- TEMPER_GENERATORS_KEY: the connections' authentication key (hex).
- TEMPER_GENERATORS_COUNT: G.
- TEMPER_GENERATOR_INDEX: set on generator ranks only: which one (0..G-1; rank N - G + index).

Stopping: SIGINT/SIGTERM to the command closes every rank's stdin: rank 0 stops serving and
the trainer ranks exit as in the colocated mode; a generator rank ends when its stdin or rank
0's connection closes.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Client, Listener
from typing import TYPE_CHECKING

from temper.distributed import launch
from temper.distributed.placement import Placement

if TYPE_CHECKING:
    from temper.server import TemperServer
    from temper.server.generators.pool import GeneratorPool

ADDRESS, KEY, COUNT, INDEX = (
    "TEMPER_GENERATORS_ADDRESS",
    "TEMPER_GENERATORS_KEY",
    "TEMPER_GENERATORS_COUNT",
    "TEMPER_GENERATOR_INDEX",
)
CONNECT_TIMEOUT_S = 300.0
"""How long rank 0 waits for the generator ranks to connect (each loads nothing first)."""


@dataclass(frozen=True)
class GeneratorLinks:
    """What the command told this rank about the generator ranks' connections."""

    host: str
    port: int
    key: bytes
    count: int
    index: int | None
    """This generator rank's index; None on a trainer rank."""


def generator_links() -> GeneratorLinks | None:
    """The variables above, or None when the command did not start a disaggregated server."""
    if ADDRESS not in os.environ:
        return None
    host, _, port = os.environ[ADDRESS].rpartition(":")
    index = os.environ.get(INDEX)
    return GeneratorLinks(
        host=host,
        port=int(port),
        key=bytes.fromhex(os.environ[KEY]),
        count=int(os.environ[COUNT]),
        index=None if index is None else int(index),
    )


def check_placement(config: TemperServer.Config, *, nproc: int | None) -> None:
    """A disaggregated placement that does not fit the ranks is a startup error."""
    placement = config.placement
    if placement.mode != "disaggregated":
        return
    if nproc is None:
        raise ValueError(
            "--placement.mode disaggregated needs --nproc N (N - --placement.generator_ranks "
            "trainer ranks, the rest generator ranks); one process serves without it"
        )
    if placement.generator_ranks >= nproc:
        raise ValueError(
            f"--placement.generator_ranks {placement.generator_ranks} leaves no trainer rank "
            f"of --nproc {nproc}: give --nproc at least {placement.generator_ranks + 1} or "
            "fewer generator ranks"
        )
    Placement(placement, world_size=nproc)
    if placement.generator_tp != 1:
        raise ValueError(
            f"--placement.generator_tp {placement.generator_tp}: the server's generator ranks "
            "each run a whole engine; use 1"
        )
    if placement.overlap_sync:
        raise ValueError(
            "--placement.overlap_sync is for the RL job's weight sync; a server's snapshots "
            "are separate samplers already: leave it off"
        )


def start_disaggregated(
    args: Sequence[str], *, nproc: int, num_generators: int, stop_on_eof: str
) -> int:
    """Start the trainer ranks (torchrun, with `stop_on_eof` added: rank 0 stops when its
    stdin closes) and the generator ranks, each on `temper ARGS`; returns torchrun's exit
    code."""
    args = list(args)
    num_trainers = nproc - num_generators
    env = launch.torchrun_environment(nproc=nproc)
    env.update(
        {
            ADDRESS: f"127.0.0.1:{_free_port()}",
            KEY: secrets.token_hex(16),
            COUNT: str(num_generators),
        }
    )
    trainers = subprocess.Popen(
        launch.torchrun_command(nproc=num_trainers, args=[*args, stop_on_eof]),
        env=env,
        stdin=subprocess.PIPE,
        start_new_session=True,
    )
    generators = [
        subprocess.Popen(
            [sys.executable, "-m", "temper", *args],
            env={**env, INDEX: str(index), "LOCAL_RANK": str(num_trainers + index)},
            stdin=subprocess.PIPE,
            start_new_session=True,
        )
        for index in range(num_generators)
    ]
    processes = [trainers, *generators]

    def stop(signum: int, frame: object) -> None:
        # Rank 0 first: the generator ranks stop once it has (finally, below).
        if not trainers.stdin.closed:
            _close_stdin(trainers)
        else:
            trainers.terminate()

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return trainers.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for process in processes:
            _close_stdin(process)
        for process in generators:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()


def listen(links: GeneratorLinks) -> Listener:
    """Rank 0: the listener the generator ranks connect to."""
    return Listener((links.host, links.port), authkey=links.key)


def accept_generators(
    listener: Listener, links: GeneratorLinks, *, config: TemperServer.Config, first_rank: int
) -> GeneratorPool:
    """Rank 0: the pool of generator ranks once each connected, with its memory budget."""
    from temper.server.generators.budget import LoadSizes, RankMemory, generator_budget_bytes
    from temper.server.generators.pool import GeneratorPool

    sizes = LoadSizes.of_config(config)
    budget_bytes = generator_budget_bytes(config, nproc=first_rank + links.count)

    def memory(rank: int) -> RankMemory:
        return RankMemory(
            rank=rank,
            budget_bytes=budget_bytes,
            idle_seconds=config.model_idle_seconds,
            sizes=sizes,
        )

    try:
        return GeneratorPool.accept(
            listener,
            count=links.count,
            first_rank=first_rank,
            call_timeout_s=config.placement.call_timeout_s,
            timeout_s=CONNECT_TIMEOUT_S,
            memory=memory,
        )
    finally:
        listener.close()


def serve_generator(config: TemperServer.Config, links: GeneratorLinks) -> int:
    """A generator rank: connect to rank 0 and serve its samplers until it or stdin closes."""
    import time

    import torch

    from temper.client.service_client import ServiceClient
    from temper.server.generators.messages import Hello, Link
    from temper.server.generators.rank import GeneratorRank

    assert links.index is not None
    device = config.device
    if device.startswith("cuda"):
        device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}"
    elif device == "cpu":
        torch.set_num_threads(config.cpu_threads())
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    while True:
        try:
            connection = Client((links.host, links.port), authkey=links.key)
            break
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                print(
                    f"temper serve: generator {links.index}: rank 0 never listened", file=sys.stderr
                )
                return 1
            time.sleep(0.2)
    link = Link(connection)
    link.send(Hello(index=links.index, pid=os.getpid()))
    service = ServiceClient(
        storage_dir=config.storage,
        device=device,
        dtype=config.dtype,
        sampler=config.sampler_config(),
        generator=config.generator,
        multi_lora=config.multi_lora,
    )
    # The command stopping closes stdin: close the link, which ends `serve`.
    threading.Thread(target=_close_on_eof, args=(link,), daemon=True).start()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the command says when to stop
    GeneratorRank(service, link=link, index=links.index).serve()
    return 0


def _close_on_eof(link: object) -> None:
    wait_for_stdin_eof()
    link.close()


def wait_for_stdin_eof() -> None:
    """Block until stdin closes (the command's word to stop), reading its file descriptor
    directly: a daemon thread blocked in `sys.stdin.buffer.read()` holds the buffered reader's
    lock, and a process that ends before its stdin closes (a generator rank whose link rank 0
    closed first) then aborts in interpreter shutdown with `Fatal Python error:
    _enter_buffered_busy`. A raw `os.read` takes no lock of Python's."""
    descriptor = sys.stdin.fileno()
    with contextlib.suppress(OSError):
        while os.read(descriptor, 65536):
            pass


def _close_stdin(process: subprocess.Popen) -> None:
    if process.stdin is not None and not process.stdin.closed:
        with contextlib.suppress(OSError):
            process.stdin.close()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
