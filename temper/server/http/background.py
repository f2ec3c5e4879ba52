"""The app's lifespan: what runs beside the requests while the app serves.

Two tasks: one runs `server.sweep()` (expired checkpoints, idle snapshots and samplers) every
`checkpoint_sweep_seconds`, the other ends sessions whose client went silent; and, with a key
file, a SIGHUP handler that reloads it. Each reads the app's server (`app.state.server`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator

from starlette.applications import Starlette

from temper.server.state.lifetimes import release_memory
from temper.server.state.server import TemperServer

log = logging.getLogger("temper.server")


@contextlib.asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    server = app.state.server
    tasks = [
        asyncio.create_task(_sweep_forever(server)),
        asyncio.create_task(_expire_forever(server)),
    ]
    loop = asyncio.get_running_loop()
    watching_sighup = False
    if server.users.key_file is not None:
        with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):
            loop.add_signal_handler(signal.SIGHUP, _reload_keys, server)  # main thread only
            watching_sighup = True
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        if watching_sighup:
            loop.remove_signal_handler(signal.SIGHUP)


async def _expire_forever(server: TemperServer) -> None:
    period = min(5.0, server.config.session_timeout_s / 4)
    while True:
        await asyncio.sleep(period)
        expired = server.expire_sessions()
        for session_id in expired:
            log.info("session %s expired (no heartbeat)", session_id)
        if expired:
            await asyncio.to_thread(release_memory)


async def _sweep_forever(server: TemperServer) -> None:
    while True:
        await asyncio.sleep(server.config.checkpoint_sweep_seconds)
        try:
            deleted = await asyncio.to_thread(server.sweep)
        except Exception:
            log.exception("checkpoint sweep failed")
            continue
        for path in deleted:
            log.info("checkpoint %s expired (ttl_seconds) and was deleted", path)


def _reload_keys(server: TemperServer) -> None:
    try:
        log.info("SIGHUP: reloaded %s: %d users", server.users.key_file, server.users.reload())
    except ValueError as error:
        log.error("SIGHUP: %s; the previous users stay in place", error)
