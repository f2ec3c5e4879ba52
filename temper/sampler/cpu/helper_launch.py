"""Start a Python child process on a Connection that can carry shared-memory tensors.

multiprocessing's spawn and forkserver contexts import the parent's `__main__` in every child,
so a script without an `if __name__ == "__main__":` guard would run again inside the helper
(a whole training run, for a script that calls the RL loop at top level). Fork is unsafe in
a process with threads and OpenMP pools. So the child here is a plain `python -c` that
imports only the target's module.

Tensors still travel as shared memory: a Connection pickles them with torch's reductions,
which pass each storage's file descriptor through the parent's multiprocessing resource
sharer. The child proves itself to that sharer with the parent's authkey, handed over on its
stdin with the parent's `sys.path` (so it imports the same `temper`). The child listens on a
Unix socket and writes the address to a pipe it inherited; the parent connects. If the child
dies before that, the pipe closes and `launch` raises instead of waiting forever.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import multiprocessing
import os
import select
import subprocess
import sys
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection, Listener

START_TIMEOUT_S = 300.0
"""Longest wait for a child to import torch and start listening."""

_BOOTSTRAP = (
    # Ctrl-C in a terminal reaches the whole process group: the parent decides what it means
    # (the child stops when its connection closes), so the child ignores it from the start.
    "import signal; signal.signal(signal.SIGINT, signal.SIG_IGN); "
    "import json, sys; setup = json.loads(sys.stdin.readline()); sys.path[:] = setup['sys_path']; "
    "from temper.sampler.cpu.helper_launch import child_main; child_main(setup)"
)


@dataclass
class ChildProcess:
    process: subprocess.Popen
    connection: Connection

    def close(self, *, timeout: float = 5.0) -> None:
        """Ask the child to stop (None), then wait; kill it if it does not stop in time."""
        with contextlib.suppress(OSError):  # already gone
            self.connection.send(None)
        self.connection.close()
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def launch(target: str, *, name: str) -> ChildProcess:
    """A child running `target` ("module:function", called with the child's Connection)."""
    authkey = multiprocessing.current_process().authkey
    ready_read, ready_write = os.pipe()
    try:
        process = subprocess.Popen(
            [sys.executable, "-c", _BOOTSTRAP],
            stdin=subprocess.PIPE,
            pass_fds=(ready_write,),
            text=True,
        )
    finally:
        os.close(ready_write)
    setup = {
        "sys_path": sys.path,
        "authkey": authkey.hex(),
        "ready_fd": ready_write,
        "target": target,
    }
    with os.fdopen(ready_read) as ready:
        process.stdin.write(json.dumps(setup) + "\n")
        process.stdin.close()
        readable, _, _ = select.select([ready], [], [], START_TIMEOUT_S)
        address = ready.readline().strip() if readable else ""
    if not address:
        process.kill()
        process.wait()
        raise RuntimeError(f"{name} did not start (exit code {process.returncode})")
    return ChildProcess(process=process, connection=Client(address, authkey=authkey))


def child_main(setup: dict) -> None:
    """The child's side of `launch`: listen, report the address, serve the connection."""
    authkey = bytes.fromhex(setup["authkey"])
    # Tensors' file descriptors come from the parent's resource sharer, which checks this key.
    multiprocessing.current_process().authkey = authkey
    with Listener(family="AF_UNIX", authkey=authkey) as listener:
        with os.fdopen(setup["ready_fd"], "w") as ready:
            ready.write(f"{listener.address}\n")
        connection = listener.accept()
    module, function = setup["target"].split(":")
    getattr(importlib.import_module(module), function)(connection)
