"""Deadlines on what crosses a process boundary: weight syncs and generator calls.

A peer rank that dies closes its connections, and gloo fails the next operation on them at
once; a peer that stalls (a hung kernel, a process stopped by the OS, a deadlock) is found
only by a timeout. This module holds what both need:

- `Deadline`: a time limit on a whole exchange (one weight sync), not on each operation of
  it. Before each collective, `Deadline.bound(group)` gives the group what is left of it as
  its timeout, so a sync of many buckets ends when its deadline passes, wherever it stalls.
- `Progress`: what an exchange is doing and how far it got ("weight sync of version 3:
  receiving bucket 5 (40.0 of 120.0 MiB) from trainer rank 1"), said by `crossing` when an
  operation fails, with whether the peer closed its connection or the deadline passed.
- `send_object` / `recv_object`: Python objects on a point-to-point link, where the receiver
  chooses how long to wait (gloo's point-to-point receive honours a per-call timeout; its
  collectives honour only the group's, which `bound` sets).

NCCL (GPU data groups) reports a timeout from its watchdog thread, which by default
(`TORCH_NCCL_ASYNC_ERROR_HANDLING=3`) ends the process without saying what it was doing. So
`wait_all` waits for NCCL work on the CPU with the deadline's time left, and raises the phase
message first; the group's own timeout is set `NCCL_GRACE_S` later, after which the watchdog
ends the process if it is still alive.

What this does not do: bound waits that have no natural end (a generator rank waiting for its
trainers' next command while they train); those use `IDLE_WAIT` and rely on a dead peer
closing its connections.
"""

from __future__ import annotations

import contextlib
import pickle
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _set_pg_timeout

IDLE_WAIT = timedelta(days=1)
"""The longest a generator rank waits for its trainers' next command or call. Trainers may
train for hours between two syncs (a long evaluation, a checkpoint of a large model), so this
is no deadline: a trainer that dies closes its connections, which ends the wait at once, and a
trainer that stalls fails its own collectives' timeouts, after which torchrun stops every rank."""

NCCL_GRACE_S = 5.0
"""Seconds an NCCL group's watchdog waits past a deadline, so that the CPU-side wait raises
the message naming the phase before the watchdog ends the process."""


class PeerFailure(RuntimeError):
    """An exchange with another rank failed: the peer died (closed its connection) or did
    not take part within the deadline. The message names the rank, the phase and how far it
    got; the job cannot go on and resumes from its last checkpoint."""


class DeadlinePassed(TimeoutError):
    """An exchange's deadline passed before its next operation began."""


@dataclass
class Deadline:
    """A time limit on a whole exchange, counted from when it is made."""

    seconds: float
    field: str
    """The setting that gives `seconds` (named in the message when it passes)."""
    started: float = field(default_factory=time.monotonic)

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def left(self) -> float:
        return self.seconds - self.elapsed()

    def bound(self, group: Any, *, grace_s: float = 0.0) -> timedelta:
        """Give `group` what is left of the deadline (plus `grace_s`) as the timeout of its
        next operations, and return what is left; raises TimeoutError once it has passed."""
        left = self.left()
        if left <= 0:
            raise DeadlinePassed(f"{self.elapsed():.1f} s since the exchange began")
        _set_pg_timeout(timedelta(seconds=left + grace_s), group)
        return timedelta(seconds=left)

    def describe(self) -> str:
        return f"{self.field}={self.seconds:g}"


@dataclass(frozen=True)
class Deadlines:
    """The deadlines of a placement (Placement.Config): of a weight sync, and of a call."""

    sync_s: float = 600.0
    call_s: float = 1800.0

    def sync(self) -> Deadline:
        """A weight sync's, or a command's, from now."""
        return Deadline(self.sync_s, field="Placement.Config.sync_timeout_s")

    def call(self) -> Deadline:
        """A generator call's (request to whole answer), from now."""
        return Deadline(self.call_s, field="Placement.Config.call_timeout_s")


@dataclass
class Progress:
    """What one exchange does and how far it got, for the message should it fail."""

    what: str
    """The exchange: 'weight sync of version 3'."""
    step: str = "starting"
    """What it was doing: 'receiving bucket 5 (40.0 of 120.0 MiB) from trainer rank 1'."""

    def describe(self) -> str:
        return f"{self.what}: {self.step}"


@contextlib.contextmanager
def crossing(
    progress: Progress | Callable[[], str], *, who: str, deadline: Deadline | None
) -> Iterator[None]:
    """Turn a failed operation inside into a `PeerFailure` that says `who` failed (this
    rank: 'generator rank 2'), the phase `progress` describes, and why: the peer closed its
    connection, or the deadline passed."""
    try:
        yield
    except PeerFailure:
        raise
    except (RuntimeError, TimeoutError) as error:
        phase = progress.describe() if isinstance(progress, Progress) else progress()
        message = failure_message(who=who, phase=phase, error=error, deadline=deadline)
        raise PeerFailure(message) from error


def failure_message(
    *, who: str, phase: str, error: BaseException, deadline: Deadline | None
) -> str:
    """'generator rank 2: weight sync of version 3: receiving bucket 5 (...) from trainer
    rank 1 failed after 10.0 s: no answer within the deadline (Placement.Config...=10) (...)'."""
    cause = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    limit = "" if deadline is None else f" ({deadline.describe()} s)"
    if isinstance(error, DeadlinePassed):
        why = f"the deadline{limit} passed before this step began: this rank or a peer stalled"
    elif _timed_out(error):
        why = f"no answer within the deadline{limit}: the peer stalled"
    else:
        why = "the peer stopped (its connection closed)"
    took = "" if deadline is None else f" after {deadline.elapsed():.1f} s"
    return (
        f"{who}: {phase} failed{took}: {why} ({cause}). The job cannot go on: resume it "
        "from its last checkpoint (temper train --resume)"
    )


def _timed_out(error: BaseException) -> bool:
    text = str(error).lower()
    return isinstance(error, TimeoutError) or "timed out" in text or "timeout" in text


def wait_idle(group: Any) -> None:
    """Let the next collectives on `group` wait up to `IDLE_WAIT` (a wait with no deadline)."""
    _set_pg_timeout(IDLE_WAIT, group)


def wait_all(works: Sequence[Any], *, deadline: Deadline | None, on_cuda: bool) -> None:
    """Wait for every work. NCCL's (`on_cuda`) are waited for on the CPU within what is left
    of `deadline`, so that a stall raises here (with the caller's phase) rather than in the
    watchdog; gloo's already run under the group's timeout that `Deadline.bound` set."""
    for work in works:
        if on_cuda and deadline is not None:
            work.wait(timedelta(seconds=max(deadline.left(), 0.001)))
        else:
            work.wait()


def send_object(message: object, *, group: Any, dst: int) -> None:
    """`message` to group rank `dst` (its size, then its pickled bytes), under the group's
    timeout."""
    payload = torch.frombuffer(bytearray(pickle.dumps(message)), dtype=torch.uint8)
    dist.send(torch.tensor([payload.numel()], dtype=torch.int64), group=group, group_dst=dst)
    dist.send(payload, group=group, group_dst=dst)


def recv_object(*, group: Any, src: int, wait: timedelta) -> Any:
    """The next object group rank `src` sends (`send_object`); waits at most `wait` for it
    to begin (the rest follows at once, under the group's timeout)."""
    size = torch.zeros(1, dtype=torch.int64)
    dist.irecv(size, group=group, group_src=src).wait(wait)
    payload = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.recv(payload, group=group, group_src=src)
    return pickle.loads(payload.numpy().tobytes())


def size_text(num_bytes: float) -> str:
    """'40.0 MiB', '12.5 KiB', '1.20 GiB': sizes in a failure message."""
    if num_bytes >= 2**30:
        return f"{num_bytes / 2**30:.2f} GiB"
    if num_bytes >= 2**20:
        return f"{num_bytes / 2**20:.1f} MiB"
    return f"{num_bytes / 2**10:.1f} KiB"
