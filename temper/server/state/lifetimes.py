"""How sessions end, and what their ids answer afterwards.

A session ends when its client calls `finish` or when its heartbeats stop for
`session_timeout_s` (the tinker SDK sends one every 10 s from a background thread, so a live
client never misses that long; a crashed notebook or a killed job does). Ending releases its
training models, sampling sessions, snapshots and queued requests; checkpoints stay. Every
id it owned is remembered here (a bounded number of them), so a later request on one answers
410 saying when and why it ended instead of a bare "unknown id" (to its owner only: anyone
else gets the same 404 as for an id that never existed).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import time
from collections import OrderedDict
from dataclasses import dataclass

from temper.server.http.errors import Gone, NotFound
from temper.server.http.users import User

MAX_REMEMBERED = 100_000
"""Most ended ids remembered; older ones answer 404 like ids never seen."""


@dataclass(frozen=True)
class Ending:
    owner: str
    what: str
    """'session sess-... expired: no heartbeat for 181 s (--session-timeout-s 180)', say."""
    at: float
    """time.time() when it ended."""
    gone: bool
    """410 Gone (its session ended); else 404 (e.g. a snapshot the retention rules evicted)."""


class EndedIds:
    """Ids of ended sessions and of what they held, each with why it ended."""

    def __init__(self, *, capacity: int = MAX_REMEMBERED) -> None:
        self.capacity = capacity
        self._endings: OrderedDict[str, Ending] = OrderedDict()

    def add(self, ids: list[str], *, owner: str, what: str, gone: bool = True) -> None:
        ending = Ending(owner=owner, what=what, at=time.time(), gone=gone)
        for ended_id in ids:
            self._endings[ended_id] = ending
            self._endings.move_to_end(ended_id)
        while len(self._endings) > self.capacity:
            self._endings.popitem(last=False)

    def check(self, ended_id: str, *, kind: str, user: User) -> None:
        """Raise Gone (or NotFound) saying why if `ended_id` (a `kind`: 'model id', say) ended
        and `user` owned it; return if not."""
        ending = self._endings.get(ended_id)
        if ending is not None and user.owns(ending.owner):
            ago = time.time() - ending.at
            error = Gone if ending.gone else NotFound
            raise error(f"{kind} {ended_id!r} is gone: {ending.what} ({ago:.0f} s ago)")


def release_memory() -> None:
    """Collect what an ended session left and hand freed heap pages back to the OS (glibc
    keeps them otherwise, and the server's RSS would never come down)."""
    gc.collect()
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return
    libc = ctypes.CDLL(libc_name)
    if hasattr(libc, "malloc_trim"):  # glibc only
        libc.malloc_trim(0)
