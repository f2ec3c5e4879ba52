"""`temper serve` on several ranks: `--nproc N` starts torchrun; under torchrun every rank
builds the same sharded backend, rank 0 serves HTTP and the others replay its calls
(temper/server/backends/replicated.py).

Stopping: the command `temper serve --nproc N` starts torchrun in a session of its own with a
pipe on its stdin and adds `--stop-on-stdin-eof` for rank 0. SIGINT/SIGTERM to the command
closes the pipe (a second one terminates torchrun), and so does the command dying; rank 0 then
stops the server, tells the other ranks to stop, and every rank leaves the process group and
exits 0. (Signalling torchrun itself would end it with an error whatever the ranks do.) Under
a bare `torchrun ... -m temper serve`, rank 0 stops on SIGINT/SIGTERM as usual; ranks > 0
ignore both and stop on rank 0's word (or when rank 0's connection closes).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from temper.commands import serve_placement
from temper.config.cli import without_option
from temper.distributed import launch
from temper.distributed.ranks import Ranks
from temper.job.long_lived import freeze_long_lived_objects

if TYPE_CHECKING:  # the server extra is imported only when serving
    from temper.client.service_client import ServiceClient
    from temper.server import TemperServer

NPROC = "--nproc"
STOP_ON_STDIN_EOF = "--stop-on-stdin-eof"
"""Added by `--nproc` for the ranks: rank 0 stops serving when its stdin closes."""


def take_options(argv: Sequence[str]) -> tuple[int | None, bool, list[str]]:
    """(--nproc N or None, --stop-on-stdin-eof given, the rest of argv for tyro)."""
    args = list(argv)
    stop_on_eof = STOP_ON_STDIN_EOF in args
    args = [arg for arg in args if arg != STOP_ON_STDIN_EOF]
    value = None
    for index, arg in enumerate(args):
        if arg == NPROC:
            value = args[index + 1] if index + 1 < len(args) else ""
        elif arg.startswith(f"{NPROC}="):
            value = arg.partition("=")[2]
    if value is not None and (not value.isdigit() or int(value) < 1):
        raise ValueError(f"--nproc {value}: give the number of processes, an int >= 1")
    nproc = None if value is None else int(value)
    return nproc, stop_on_eof, without_option(args, NPROC)


def start_ranks(argv: Sequence[str], *, nproc: int, num_generators: int = 0) -> int:
    """Run `temper serve ARGV` on `nproc` ranks of this machine, the last `num_generators` of
    them generator ranks (serve_placement.py); returns torchrun's exit code."""
    if num_generators:
        return serve_placement.start_disaggregated(
            ["serve", *without_option(list(argv), NPROC)],
            nproc=nproc,
            num_generators=num_generators,
            stop_on_eof=STOP_ON_STDIN_EOF,
        )
    args = ["serve", *without_option(list(argv), NPROC), STOP_ON_STDIN_EOF]
    process = subprocess.Popen(
        launch.torchrun_command(nproc=nproc, args=args),
        env=launch.torchrun_environment(nproc=nproc),
        stdin=subprocess.PIPE,
        start_new_session=True,  # a terminal's Ctrl-C reaches this process only
    )

    def stop(signum: int, frame: object) -> None:
        if not process.stdin.closed:
            process.stdin.close()  # rank 0 stops serving; every rank exits cleanly
        else:
            process.terminate()

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return process.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if not process.stdin.closed:
            process.stdin.close()


def check_models(config: TemperServer.Config) -> None:
    """The served models' directories read, and one trainable: the ranks > 0 only train
    (the samplers, sample-only models' included, run on rank 0, or on the generator ranks of
    a disaggregated placement)."""
    from temper.server.state.base_models import model_dirs, read_model_config

    dirs = model_dirs(
        models=config.model, sample_only=config.sample_only_model, models_dir=config.models_dir
    )
    if not any(trainable for _, trainable in dirs):
        raise ValueError("serving on several ranks takes a trainable model (--model DIR)")
    for path, _ in dirs:
        read_model_config(path)


def check_generator_backend(config: TemperServer.Config, *, nproc: int) -> None:
    """Colocated, rank 0 samples inside the process group, where the vLLM backend cannot run
    (temper/job/model.py, `check_generator_ranks`): refused before torchrun starts."""
    colocated = config.placement.mode != "disaggregated"
    if colocated and nproc > 1 and config.generator.backend == "vllm":
        raise ValueError(
            f"--generator.backend vllm runs in one process, not on the {nproc} colocated "
            "ranks of --nproc: use --generator.backend temper with --nproc, or drop --nproc"
        )


def serve_on_ranks(config: TemperServer.Config, *, stop_on_stdin_eof: bool) -> int:
    """One rank of `temper serve` under torchrun (every rank calls this). In a disaggregated
    placement these are the trainer ranks (serve_placement.py starts the generator ranks)."""
    from temper.client.service_client import ServiceClient
    from temper.job import check_generator_ranks
    from temper.server.backends.replicated import follow, replay_ranks
    from temper.trainer.sharding import Sharding

    if config.trainer.sharding is None:  # default: FSDP over every (trainer) rank
        trainer = dataclasses.replace(config.trainer, sharding=Sharding.Config())
        config = dataclasses.replace(config, trainer=trainer)
    on_cuda = config.device.startswith("cuda")
    links = serve_placement.generator_links()
    disaggregated = config.placement.mode == "disaggregated"
    rank = launch.init_from_env(device_type="cuda" if on_cuda else "cpu")
    ranks = replay_ranks()
    pids = ranks.all_gather(os.getpid())
    listener = None
    if disaggregated and links is not None and ranks.is_writer:
        listener = serve_placement.listen(links)  # before any rank can fail: they connect
    service = backend = server = None
    try:
        error = None
        try:
            _check_rank_config(config, links=links, disaggregated=disaggregated)
            if not disaggregated:
                check_generator_ranks(
                    config.generator, ranks=ranks, field="TemperServer.Config.generator"
                )
            service = ServiceClient(
                storage_dir=config.storage,
                device=str(rank.device) if on_cuda else config.device,
                dtype=config.dtype,
                trainer=config.trainer,
                sampler=config.sampler_config(),
            )
            if ranks.is_writer:
                backend, health = _writer_backend(
                    config, service, ranks=ranks, pids=pids, listener=listener, links=links
                )
                server = config.build(backend=backend)
                server.rank_health = health
        except (ValueError, FileNotFoundError, RuntimeError) as caught:
            error = f"{caught}"
        errors = ranks.all_gather(error)
        if any(errors):
            if ranks.is_writer:
                for index, message in enumerate(errors):
                    if message is not None:
                        print(f"temper serve: error (rank {index}): {message}", file=sys.stderr)
            return 2
        if not ranks.is_writer:
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, signal.SIG_IGN)  # rank 0 says when to stop
            if disaggregated:
                from temper.server.backends.disaggregated import PayloadReplica, follow_trainers

                multi_lora = config.multi_lora.enabled
                follow_trainers(PayloadReplica(service, ranks=ranks, multi_lora=multi_lora))
            else:
                follow(service, ranks=ranks)
            return 0
        try:
            _serve_http(server, ranks=ranks, stop_on_stdin_eof=stop_on_stdin_eof)
        finally:
            backend.stop()
        return 0
    finally:
        del service, backend, server  # FSDP modules must go before the process group
        launch.shutdown()


def _check_rank_config(config: TemperServer.Config, *, links: object, disaggregated: bool) -> None:
    if disaggregated and links is None:
        raise ValueError(
            "--placement.mode disaggregated runs under `temper serve --nproc N`, which starts "
            "the generator ranks outside torchrun (a generator rank that dies must not end "
            "the others); under a bare torchrun use --placement.mode colocated"
        )
    check_models(config)


def _writer_backend(
    config: TemperServer.Config,
    service: ServiceClient,
    *,
    ranks: Ranks,
    pids: list[int],
    listener: object,
    links: object,
) -> tuple[object, object]:
    """Rank 0's backend and the health of every rank (for healthz)."""
    from temper.server.backends.replicated import ReplicatedService
    from temper.server.http.request_log import configure_logging
    from temper.server.http.security import check_bind

    check_bind(config.host, config.api_key, key_file=config.key_file)
    configure_logging(config.log_level)
    replicated = ReplicatedService(service, ranks=ranks)
    if config.placement.mode != "disaggregated":

        def trainers() -> list[dict]:
            return [
                {"rank": r, "role": "trainer", "pid": pid, "alive": True}
                for r, pid in enumerate(pids)
            ]

        return replicated, trainers
    from temper.server.backends.disaggregated import DisaggregatedService, PayloadReplica

    replicated.replica = PayloadReplica(service, ranks=ranks, multi_lora=config.multi_lora.enabled)
    pool = serve_placement.accept_generators(
        listener, links, config=config, first_rank=ranks.world_size
    )
    backend = DisaggregatedService(replicated, pool=pool)
    return backend, lambda: backend.health(pids)


def http_server(server: TemperServer, *, detail: str = "") -> Any:
    """The uvicorn server of `server`'s app (a `uvicorn.Server`), after printing where it
    listens; one process or rank 0 of several."""
    import uvicorn

    from temper.server import create_app

    config = server.config
    extra = f", {detail}" if detail else ""
    print(
        f"temper serve: {server.served_names()} on http://{config.host}:{config.port} "
        f"(fine-tuning: {config.fine_tuning}, storage: {server.catalog.storage.root}{extra})",
        flush=True,
    )
    http = uvicorn.Server(
        uvicorn.Config(
            create_app(server),
            host=config.host,
            port=config.port,
            log_level=config.log_level,
            access_log=False,  # the request log (temper.server.requests) has every request
        )
    )
    freeze_startup_objects()
    return http


def freeze_startup_objects() -> None:
    """Move what is alive now (imported modules, loaded base models, the app) out of the
    cyclic garbage collector's view: it lives as long as the process, and every full
    collection would walk all of it again. The server allocates many short-lived objects per
    request, so its full collections come every few dozen RL steps, each about 0.2 s of CPU
    for the tiny model (docs/benchmarks.md, `server_overhead.py`)."""
    freeze_long_lived_objects()


def _serve_http(server: TemperServer, *, ranks: Ranks, stop_on_stdin_eof: bool) -> None:
    """Rank 0: the HTTP server, until SIGINT/SIGTERM (or stdin closes, if asked)."""
    placement = server.config.placement
    detail = f"{ranks.world_size} ranks"
    if placement.mode == "disaggregated":
        detail = (
            f"{_count(ranks.world_size, 'trainer rank')}, "
            f"{_count(placement.generator_ranks, 'generator rank')}"
        )
    uvicorn_server = http_server(server, detail=detail)
    if stop_on_stdin_eof:
        threading.Thread(target=_stop_on_eof, args=(uvicorn_server,), daemon=True).start()
    run_until_stopped(uvicorn_server)


def run_until_stopped(uvicorn_server: Any) -> None:
    """Serve until SIGINT/SIGTERM, then return. uvicorn re-raises the signal that stopped it
    once it has shut down; with the default handlers that would end one process with a
    KeyboardInterrupt traceback (or exit status -15) after a clean shutdown, and kill rank 0
    of several before it tells the other ranks to stop."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _ignore)
    uvicorn_server.run()


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"


def _ignore(signum: int, frame: object) -> None:
    pass


def _stop_on_eof(uvicorn_server: Any) -> None:
    serve_placement.wait_for_stdin_eof()
    uvicorn_server.should_exit = True
