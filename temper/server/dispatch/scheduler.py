"""Ordered per-model queues, and the futures that `retrieve_future` answers.

A route validates a request, hands the scheduler a `call` and gets a request id back at once.
Calls for one training model run in arrival order on that model's dispatcher thread: each
call invokes one backend verb, which either returns an `APIFuture` at once (the backend runs
it on its own worker, in the order it was submitted) or blocks until done (creating a model,
`save_weights_and_get_sampling_client`); either way the next call of that model is submitted
only after it, so a model's requests keep Tinker's ordering without the routes ever blocking.
Sampling calls have no order and are submitted straight from the route.

Each request gets one asyncio task that waits for its result and encodes it for the wire
exactly once, so a result polled twice (the SDK re-polls after a lost response) is the same.
A repeated submission with the same key (`(model_id, seq_id)`, `(sampling session, seq_id)`)
gets the same request id and does not run twice. Finished results are dropped `result_ttl_s`
after they finished.

Each request belongs to the user who sent it and to a session (its scope): other users'
request ids answer 404, a user's unfinished requests are counted (`queued`, for the per-user
limit), and when a session ends its requests are cancelled and forgotten (`drop_scope`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from temper.api.futures import APIFuture, Worker
from temper.server.http.errors import NotFound, bounded, category_of
from temper.server.http.users import User
from temper.server.state.ids import new_request_id

log = logging.getLogger("temper.server")

PROTOBUF = "application/x-protobuf"
JSON = "application/json"


@dataclass(frozen=True)
class Answer:
    """A finished request as `retrieve_future` sends it."""

    content: bytes
    media_type: str = JSON


@dataclass
class _Entry:
    task: asyncio.Task[Answer]
    key: Hashable | None
    owner: str
    scope: str
    finished_at: float | None = None


@dataclass
class Scheduler:
    result_ttl_s: float = 900.0
    """How long a finished result stays retrievable."""
    _entries: dict[str, _Entry] = field(default_factory=dict)
    _by_key: dict[Hashable, str] = field(default_factory=dict)
    _dispatchers: dict[str, Worker] = field(default_factory=dict)
    _queued: dict[str, int] = field(default_factory=dict)
    """Unfinished requests per owner."""
    _last_prune: float = 0.0

    def submit(
        self,
        call: Callable[[], Any],
        *,
        encode: Callable[[Any], Answer],
        owner: str,
        scope: str,
        queue: str | None = None,
        key: Hashable | None = None,
    ) -> str:
        """Run `call` (after earlier calls of `queue`, or right now) and return the request id.

        `call` returns a result or an `APIFuture` (or asyncio future) of one; `encode` turns
        the result into the wire answer. `owner` (a user name) may retrieve it; `scope` (a
        session id) ending cancels it. Without a queue, an exception from `call` itself
        propagates to the route (the request is rejected); every later failure becomes a
        failed future.
        """
        if key is not None and key in self._by_key:
            return self._by_key[key]
        self._prune()
        started: Any = call() if queue is None else self._dispatcher(queue).submit(call)
        request_id = new_request_id()
        task = asyncio.get_running_loop().create_task(self._settle(started, encode, request_id))
        entry = _Entry(task=task, key=key, owner=owner, scope=scope)
        self._queued[owner] = self._queued.get(owner, 0) + 1
        task.add_done_callback(lambda _: self._finished(entry))
        self._entries[request_id] = entry
        if key is not None:
            self._by_key[key] = request_id
        return request_id

    def known(self, key: Hashable) -> str | None:
        """The request id already given to a submission with this key, if any."""
        return self._by_key.get(key)

    def queued(self, owner: str) -> int:
        """How many of `owner`'s requests have not finished."""
        return self._queued.get(owner, 0)

    async def retrieve(self, request_id: str, *, user: User, timeout: float) -> Answer | None:
        """The answer, or None if it is not ready within `timeout` seconds (long poll)."""
        entry = self._entries.get(request_id)
        if entry is None or not user.owns(entry.owner):
            raise NotFound(
                f"unknown or expired request id {request_id!r} (results are kept "
                f"{self.result_ttl_s:g} s; a request of an ended session is dropped with it)"
            )
        if entry.task.done():
            return entry.task.result()
        done, _ = await asyncio.wait({entry.task}, timeout=timeout)
        return entry.task.result() if done else None

    def close_queue(self, queue: str) -> None:
        """Forget a model's dispatcher; calls queued and not started are cancelled (their
        requests then fail), and its thread ends after the one running, if any."""
        dispatcher = self._dispatchers.pop(queue, None)
        if dispatcher is not None:
            dispatcher.close(wait=False, cancel_pending=True)

    def drop_scope(self, scope: str) -> None:
        """Cancel and forget the requests of an ended session."""
        for request_id, entry in list(self._entries.items()):
            if entry.scope == scope:
                entry.task.cancel()
                del self._entries[request_id]
                if entry.key is not None:
                    self._by_key.pop(entry.key, None)

    def _finished(self, entry: _Entry) -> None:
        entry.finished_at = time.monotonic()
        left = self._queued[entry.owner] - 1
        if left:
            self._queued[entry.owner] = left
        else:
            del self._queued[entry.owner]

    def _dispatcher(self, queue: str) -> Worker:
        if queue not in self._dispatchers:
            self._dispatchers[queue] = Worker(f"temper-serve-{queue}")
        return self._dispatchers[queue]

    async def _settle(
        self, started: Any, encode: Callable[[Any], Answer], request_id: str
    ) -> Answer:
        try:
            value = started
            while isinstance(value, APIFuture | asyncio.Future):
                value = await value
            return encode(value)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # this request is being dropped (its session ended)
            # A queued call cancelled because its model was released.
            return failure("request cancelled: its model was released", category="user")
        except Exception as error:
            category = category_of(error)
            if category == "server":
                log.exception("request %s failed", request_id)
            else:
                log.info("request %s failed: %s", request_id, error)
            return failure(f"{type(error).__name__}: {error}", category=category)

    def _prune(self) -> None:
        now = time.monotonic()
        if now - self._last_prune < 10.0:
            return
        self._last_prune = now
        expired = [
            request_id
            for request_id, entry in self._entries.items()
            if entry.finished_at is not None and now - entry.finished_at > self.result_ttl_s
        ]
        for request_id in expired:
            entry = self._entries.pop(request_id)
            if entry.key is not None:
                self._by_key.pop(entry.key, None)


def failure(message: str, *, category: str) -> Answer:
    return Answer(json.dumps({"error": bounded(message), "category": category}).encode())
