"""Rank 0's view of the generator ranks of a disaggregated server, and the routing of calls.

Each generator rank is a `Remote`: its link, the samplers it holds (keys), its calls in
flight and the sequences they sample. A call on a sampler goes to a live rank that holds it,
the least loaded (fewest sequences in flight) when several do, unless another rank has
`MOVE_COST` fewer sequences in flight; when none holds it (first use, or its rank died), or
to spread the load so, the chosen rank is sent the sampler's `Load` first (rank 0 keeps
every live sampler's load: a snapshot's adapter or weights in host memory, a base model or
checkpoint by name). Each rank has a model memory budget (budget.py): a sampler goes only to
a rank that holds it or has room for it, preferring those with room as they are, then those
with room once the idle and least recently used base-model and checkpoint samplers there not
in use are released (they are dropped there, and load again on their next call); a sampler
that fits no live rank fails with the 503 one process answers (`OverBudget`). A rank whose
link closes is dead: its calls in flight are sent again, the same way, to another live rank
(each call at most once per rank), and fail with `GeneratorLost` only when no live rank is
left. Every call has a deadline
(`call_timeout_s`): past it the call fails with a TimeoutError naming the rank, whatever that
rank does. Nothing here is a torch.distributed collective.

An in-flight target (`LoadInflight`) is one key whose load changes: `publish` sends each
newer one to the ranks that hold the target, and a rank that loads it later is sent the
newest (under the same per-rank lock, so no rank is left on an older save).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing import AuthenticationError
from multiprocessing.connection import Listener
from typing import Any

from temper.server.generators.budget import RankMemory
from temper.server.generators.messages import (
    Drop,
    Hello,
    Link,
    Load,
    LoadInflight,
    Reply,
    Request,
    Sample,
    Score,
)
from temper.server.state.model_memory import OverBudget

log = logging.getLogger("temper.server")
MOVE_COST = 16
"""Sequences in flight that sending a sampler to another rank counts as: a call goes to a
rank that holds its sampler unless another one has this many fewer sequences in flight."""


def _answer(
    result: concurrent.futures.Future, *, value: Any = None, error: BaseException | None = None
) -> None:
    """Answer a call's future, unless its client cancelled it meanwhile (cancel_future):
    a cancelled call's answer is dropped."""
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        if error is not None:
            result.set_exception(error)
        else:
            result.set_result(value)


class GeneratorLost(RuntimeError):
    """No live generator rank could run the call (every one that held it died)."""


@dataclass
class _Pending:
    future: concurrent.futures.Future
    sequences: int
    deadline: float


@dataclass(eq=False)
class Remote:
    """One generator rank as rank 0 sees it."""

    index: int
    rank: int
    pid: int
    link: Link
    memory: RankMemory
    alive: bool = True
    held: set[str] = field(default_factory=set)
    """Samplers loaded there (`memory` also counts those being loaded)."""
    busy: Counter[str] = field(default_factory=Counter)
    """Calls routed to each sampler there and not finished: never released meanwhile."""
    sequences_in_flight: int = 0
    pending: dict[int, _Pending] = field(default_factory=dict)
    loading: dict[str, threading.Lock] = field(default_factory=dict)


class GeneratorPool:
    def __init__(self, remotes: list[Remote], *, call_timeout_s: float) -> None:
        self.remotes = remotes
        self.call_timeout_s = call_timeout_s
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._routes = concurrent.futures.ThreadPoolExecutor(
            max_workers=64, thread_name_prefix="temper-route"
        )
        self._closed = threading.Event()
        self._newest: dict[str, LoadInflight] = {}  # in-flight targets' latest saves, by key
        for remote in remotes:
            threading.Thread(
                target=self._read, args=(remote,), name=f"temper-link-{remote.rank}", daemon=True
            ).start()
        threading.Thread(target=self._watch, name="temper-deadlines", daemon=True).start()

    @classmethod
    def accept(
        cls,
        listener: Listener,
        *,
        count: int,
        first_rank: int,
        call_timeout_s: float,
        timeout_s: float,
        memory: Callable[[int], RankMemory],
    ) -> GeneratorPool:
        """Wait (at most `timeout_s`) for `count` generator ranks to connect and say hello;
        `memory(rank)` is the budget of generator rank `rank`."""
        remotes: list[Remote | None] = [None] * count
        arrived: queue.Queue[tuple[Hello, Link]] = queue.Queue()

        def accept_all() -> None:
            for _ in range(count):
                try:
                    link = Link(listener.accept())
                    arrived.put((link.receive(), link))
                except (OSError, EOFError, AuthenticationError):
                    return  # the listener closed (deadline), or a stray connection

        threading.Thread(target=accept_all, name="temper-accept", daemon=True).start()
        deadline = time.monotonic() + timeout_s
        for _ in range(count):
            try:
                hello, link = arrived.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            assert isinstance(hello, Hello), hello
            rank = first_rank + hello.index
            remotes[hello.index] = Remote(
                index=hello.index, rank=rank, pid=hello.pid, link=link, memory=memory(rank)
            )
        missing = [first_rank + i for i, remote in enumerate(remotes) if remote is None]
        if missing:
            raise RuntimeError(
                f"generator ranks {missing} did not connect to rank 0 within {timeout_s:g} s "
                "(see their output above)"
            )
        return cls(
            [remote for remote in remotes if remote is not None], call_timeout_s=call_timeout_s
        )

    # -- calls -------------------------------------------------------------------------------

    def call(
        self, load: Load, op: Sample | Score, *, sequences: int = 1
    ) -> concurrent.futures.Future:
        """Run `op` on a rank that holds `load`'s sampler (sending it `load` first if none
        does); the future fails with GeneratorLost only if every live rank was tried."""
        result: concurrent.futures.Future = concurrent.futures.Future()
        self._routes.submit(self._route, load, op, sequences, result, frozenset())
        return result

    def place(self, load: Load) -> None:
        """Send `load` to the least loaded live rank with room now (blocks; raises its
        error): a bad checkpoint fails when its sampling client is made, not at its first
        sample, and one that fits no rank's budget with OverBudget (503)."""
        tried: frozenset[int] = frozenset()
        while True:
            remote = self._choose(load, tried=tried)  # GeneratorLost when none is left
            try:
                self._ensure(remote, load)
                return
            except GeneratorLost:  # it died while loading: the next live rank
                tried |= {remote.index}
            finally:
                self._finished(remote, load.key)

    def publish(self, load: LoadInflight) -> None:
        """An in-flight target's newer save: sent now to every live rank that holds the
        target (blocks until they have it; raises a rank's error, e.g. a full multi-LoRA
        sampler, and the ranks that load the target later get the save before); the ranks
        that load it later get the newest."""
        with self._lock:
            previous = self._newest.get(load.key)
            self._newest[load.key] = load
        try:
            for remote in self.remotes:
                with self._key_lock(remote, load.key):
                    with self._lock:
                        held = remote.alive and load.key in remote.held
                    if held:  # a rank that died meanwhile is skipped: calls go elsewhere
                        with contextlib.suppress(GeneratorLost):
                            self._send(remote, load, sequences=0).result()
        except BaseException:
            with self._lock:
                if self._newest.get(load.key) is load and previous is not None:
                    self._newest[load.key] = previous
            raise

    def drop(self, key: str) -> None:
        """Every rank forgets `key` (its sampling client on rank 0 was released)."""
        with self._lock:
            self._newest.pop(key, None)
        for remote in self.remotes:
            with self._lock:
                held = remote.alive and key in remote.held
                remote.held.discard(key)
                remote.memory.release(key)
            if held:
                self._send(remote, Drop(key), sequences=0)

    def health(self) -> list[dict[str, Any]]:
        return [
            {"rank": r.rank, "role": "generator", "pid": r.pid, "alive": r.alive}
            for r in self.remotes
        ]

    def close(self) -> None:
        self._closed.set()
        for remote in self.remotes:
            remote.link.close()
        self._routes.shutdown(wait=False, cancel_futures=True)

    def _route(
        self,
        load: Load,
        op: Sample | Score,
        sequences: int,
        result: concurrent.futures.Future,
        tried: frozenset[int],
    ) -> None:
        if result.cancelled():  # its client cancelled it (cancel_future) before it was sent
            return
        try:
            remote = self._choose(load, tried=tried)
        except Exception as error:  # GeneratorLost, OverBudget
            _answer(result, error=error)
            return
        tried = tried | {remote.index}
        try:
            self._ensure(remote, load)
            inner = self._send(remote, op, sequences=sequences)
        except GeneratorLost:  # it died while loading the sampler: the next live rank
            self._finished(remote, load.key)
            self._routes.submit(self._route, load, op, sequences, result, tried)
            return
        except Exception as error:
            self._finished(remote, load.key)
            _answer(result, error=error)
            return

        def done(inner: concurrent.futures.Future) -> None:
            self._finished(remote, load.key)
            error = inner.exception()
            if isinstance(error, GeneratorLost):  # its rank died: try another
                log.warning("%s; sending the call to another generator rank", error)
                self._routes.submit(self._route, load, op, sequences, result, tried)
            elif error is not None:
                _answer(result, error=error)
            else:
                _answer(result, value=inner.result())

        inner.add_done_callback(done)

    def _choose(self, load: Load, *, tried: frozenset[int]) -> Remote:
        """The rank for a call on `load`'s sampler, its memory counted there and the sampler
        marked busy until `_finished`."""
        key = load.key
        with self._lock:
            live = [r for r in self.remotes if r.alive and r.index not in tried]
            if not live:
                dead = [r.rank for r in self.remotes if not r.alive]
                raise GeneratorLost(
                    f"no live generator rank can run this call (dead: ranks {dead}); retry "
                    "once the server's generator ranks are back (GET /api/v1/healthz)"
                )
            room = [r for r in live if key in r.held or r.memory.room_for(load, keep=r.busy)]
            if not room:
                raise _no_room(load, live)
            remote = min(room, key=lambda r: _preference(r, load))
            released = self._admit(remote, load)
            remote.busy[key] += 1
            remote.memory.use(key)
        self._drop_released(remote, released)
        return remote

    def _finished(self, remote: Remote, key: str) -> None:
        with self._lock:
            if remote.busy[key] > 1:
                remote.busy[key] -= 1
            else:
                remote.busy.pop(key, None)

    def _admit(self, remote: Remote, load: Load) -> list[str]:
        """Count `load` in `remote`'s budget (under the lock); the samplers it released
        there are no longer held (`_drop_released` tells the rank)."""
        released = remote.memory.admit(load, keep=remote.busy)
        remote.held.difference_update(released)
        return released

    def _drop_released(self, remote: Remote, keys: list[str]) -> None:
        """Tell `remote` to drop the samplers its budget released, unless a call loaded one
        there again meanwhile (under the key's lock, so a Drop never follows that Load). A
        key being loaded is busy, so never released: no two threads wait on each other."""
        for key in keys:
            with self._key_lock(remote, key):
                with self._lock:
                    loaded_again = key in remote.held
                if not loaded_again:
                    log.info("generator rank %d releases sampler %s", remote.rank, key)
                    self._send(remote, Drop(key), sequences=0)

    def _ensure(self, remote: Remote, load: Load) -> None:
        """`remote` holds `load.key` once this returns (one load per rank and key at once)."""
        with self._key_lock(remote, load.key):
            if load.key in remote.held:
                return
            with self._lock:  # counted again if a load before this one failed
                load = self._newest.get(load.key, load)
                released = self._admit(remote, load)
            self._drop_released(remote, released)
            try:
                self._send(remote, load, sequences=0).result()
            except BaseException:
                with self._lock:
                    if load.key not in remote.held:
                        remote.memory.release(load.key)
                raise
            with self._lock:
                remote.held.add(load.key)

    def _key_lock(self, remote: Remote, key: str) -> threading.Lock:
        """Held while `remote` is sent a load of `key`."""
        with self._lock:
            return remote.loading.setdefault(key, threading.Lock())

    def _send(self, remote: Remote, op: object, *, sequences: int) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        call_id = next(self._ids)
        with self._lock:
            if not remote.alive:
                future.set_exception(self._lost(remote))
                return future
            remote.pending[call_id] = _Pending(
                future, sequences, deadline=time.monotonic() + self.call_timeout_s
            )
            remote.sequences_in_flight += sequences
        try:
            remote.link.send(Request(call_id, op))
        except (OSError, ValueError):
            self._died(remote)
        return future

    def _read(self, remote: Remote) -> None:
        while True:
            try:
                reply = remote.link.receive()
            except (EOFError, OSError, ValueError):
                break
            self._settle(remote, reply)
        self._died(remote)

    def _settle(self, remote: Remote, reply: Reply) -> None:
        with self._lock:
            pending = remote.pending.pop(reply.call_id, None)
            if pending is None:  # past its deadline already
                return
            remote.sequences_in_flight -= pending.sequences
        if reply.error is not None:
            pending.future.set_exception(reply.error)
        else:
            pending.future.set_result(reply.value)

    def _died(self, remote: Remote) -> None:
        with self._lock:
            if not remote.alive:
                return
            remote.alive = False
            remote.held.clear()
            remote.memory.clear()
            pending = list(remote.pending.values())
            remote.pending.clear()
            remote.sequences_in_flight = 0
        if not self._closed.is_set():
            log.error(
                "generator rank %d (pid %d) is gone: %d calls in flight go to the other "
                "generator ranks",
                remote.rank,
                remote.pid,
                len(pending),
            )
        for item in pending:
            item.future.set_exception(self._lost(remote))

    def _lost(self, remote: Remote) -> GeneratorLost:
        return GeneratorLost(f"generator rank {remote.rank} (pid {remote.pid}) died")

    def _watch(self, *, every_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        """Fail the calls past their deadline (a rank that stalls without dying), and
        release the samplers idle for --model-idle-seconds."""
        while not self._closed.wait(every_s):
            self._release_idle()
            now = clock()
            late: list[tuple[Remote, _Pending]] = []
            with self._lock:
                for remote in self.remotes:
                    for call_id, item in list(remote.pending.items()):
                        if item.deadline < now:
                            del remote.pending[call_id]
                            remote.sequences_in_flight -= item.sequences
                            late.append((remote, item))
            for remote, item in late:
                item.future.set_exception(
                    TimeoutError(
                        f"generator rank {remote.rank} did not answer a call within "
                        f"{self.call_timeout_s:g} s (--placement.call-timeout-s)"
                    )
                )

    def _release_idle(self) -> None:
        for remote in self.remotes:
            with self._lock:
                if not remote.alive:
                    continue
                released = remote.memory.release_idle(keep=remote.busy)
                remote.held.difference_update(released)
            self._drop_released(remote, released)


def _preference(remote: Remote, load: Load) -> tuple[bool, int]:
    """Lower is better: a rank that holds the sampler or has room without releasing any,
    then the fewest sequences in flight (counting `MOVE_COST` for sending the sampler)."""
    if load.key in remote.held:
        return False, remote.sequences_in_flight
    return not remote.memory.free_for(load), remote.sequences_in_flight + MOVE_COST


def _no_room(load: Load, live: list[Remote]) -> OverBudget:
    """The 503 for a sampler that fits no live rank: the first one's refusal."""
    refusal = live[0].memory.refusal(load)
    if len(live) == 1:
        return refusal
    others = [remote.rank for remote in live[1:]]
    return OverBudget(f"{refusal.message} (nor does generator rank(s) {others} have room)")
