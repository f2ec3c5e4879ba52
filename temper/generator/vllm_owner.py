"""vLLM's own processes end with the process that owns the engine.

vLLM's engine process (engine_process='separate', tensor parallelism) is a child of the
process that builds the `LLM`, and its workers are children of the engine process. A worker
ends when the engine process does (vLLM gives each a pipe that closes then), but nothing ends
the engine process when its owner dies without closing it (killed, `os._exit`, stopped by
torchrun): it is reparented and lives on with its workers, holding memory, cores and, on a
GPU, the device (measured: tests/distributed/test_sync_deadline_vllm.py).

So each worker watches the owner. The owner holds an `OwnerBeacon`: a TCP store that only
its vLLM processes connect to, whose address is in `OWNER_ENV` while the `LLM` is built (the
processes vLLM starts then inherit it; none started later does). Importing
generator/vllm_transfer.py, which vLLM does in each worker before it loads the model, calls
`watch_owner_if_announced`: a daemon thread connects to the store and blocks on a key that is
never set. The owner's death closes that connection at once (no polling); the thread then
kills the engine process, the worker's parent (only while it still is its parent, so never a
process that took its pid since), and ends the worker. Every worker does so; vLLM's pipe ends
those whose own watch has not yet acted.

An owner that closes its engine shuts vLLM's processes down before it drops the beacon, so
the watch does not fire on a normal end. Not covered: the owner dying in the seconds of the
engine's start before its workers exist. POSIX only (signals, `os.getppid`).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import threading
from collections.abc import Iterator

import torch.distributed as dist

OWNER_ENV = "TEMPER_VLLM_OWNER"
"""'HOST:PORT:PID' of the beacon and its owner, set while an engine in its own processes is
built (read only by `watch_owner_if_announced`)."""
_NEVER_SET = "temper-vllm-owner-watch"
_WAIT = datetime.timedelta(hours=1)  # one wait on the store; the watch waits again after it


class OwnerBeacon:
    """In the owner: the store its vLLM processes watch (see the module docstring). Keep it
    as long as the engine runs."""

    def __init__(self) -> None:
        self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    @contextlib.contextmanager
    def announced(self) -> Iterator[None]:
        """Processes started inside this block (vLLM's, as the `LLM` is built) watch it."""
        previous = os.environ.get(OWNER_ENV)
        os.environ[OWNER_ENV] = f"127.0.0.1:{self._store.port}:{os.getpid()}"
        try:
            yield
        finally:
            if previous is None:
                del os.environ[OWNER_ENV]
            else:
                os.environ[OWNER_ENV] = previous


def watch_owner_if_announced() -> threading.Thread | None:
    """In a vLLM process started inside `OwnerBeacon.announced`: end it, and its engine
    process, once the owner dies. Elsewhere (the owner itself, no beacon): nothing."""
    setting = os.environ.get(OWNER_ENV)
    if not setting:
        return None
    host, port, owner = setting.rsplit(":", 2)
    if int(owner) == os.getpid():
        return None
    store = dist.TCPStore(host, int(port), is_master=False, timeout=_WAIT)
    thread = threading.Thread(
        target=_watch,
        args=(store,),
        kwargs={"engine_process": os.getppid(), "owner": int(owner)},
        name="temper-vllm-owner-watch",
        daemon=True,
    )
    thread.start()
    return thread


def _watch(store: dist.TCPStore, *, engine_process: int, owner: int) -> None:
    while True:
        try:
            store.wait([_NEVER_SET], _WAIT)
        except dist.DistNetworkError:
            break  # the owner's end of the connection closed: it died
        except dist.DistStoreError:
            continue  # the wait's own time limit
    # A worker inside the engine process (its parent is the owner) ends the engine by ending.
    if engine_process != owner and os.getppid() == engine_process:
        os.kill(engine_process, signal.SIGKILL)
    os._exit(1)
