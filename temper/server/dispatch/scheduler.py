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

A client may cancel a request (`cancel`): one not started yet never runs (a queued call is
skipped when its turn comes, a held sample is never started); one running finishes, and its
result is dropped. Either way the request answers a failure saying it was cancelled. A sample
request names its feed (feeds.py), which hears of it once it finished, for `retrieve_futures`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tinker import types as tinker_types

from temper.api.futures import APIFuture, Worker
from temper.server.dispatch.feeds import SamplingFeeds
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
    failed: bool = False
    """An error answer (`failure`)."""


CANCELLED = "request cancelled by its client (cancel_future)"


class _Cancelled(Exception):
    """A queued call whose request was cancelled before its turn."""


@dataclass
class _Entry:
    key: Hashable | None
    owner: str
    scope: str
    feed: Hashable | None = None
    task: asyncio.Task[Answer] | None = None
    started: Any = None
    """What `call` returned (an asyncio future that a held sample fills when it starts)."""
    cancelled: bool = False
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
    feeds: SamplingFeeds = field(default_factory=SamplingFeeds)

    def submit(
        self,
        call: Callable[[], Any],
        *,
        encode: Callable[[Any], Answer],
        owner: str,
        scope: str,
        queue: str | None = None,
        key: Hashable | None = None,
        feed: Hashable | None = None,
    ) -> str:
        """Run `call` (after earlier calls of `queue`, or right now) and return the request id.

        `call` returns a result or an `APIFuture` (or asyncio future) of one; `encode` turns
        the result into the wire answer. `owner` (a user name) may retrieve it; `scope` (a
        session id) ending cancels it; `feed` hears when it finished. Without a queue, an
        exception from `call` itself propagates to the route (the request is rejected); every
        later failure becomes a failed future.
        """
        if key is not None and key in self._by_key:
            return self._by_key[key]
        self._prune()
        entry = _Entry(key=key, owner=owner, scope=scope, feed=feed)
        if queue is None:
            entry.started = call()
        else:
            entry.started = self._dispatcher(queue).submit(_unless_cancelled(entry, call))
        request_id = new_request_id()
        entry.task = asyncio.get_running_loop().create_task(self._settle(entry, encode, request_id))
        self._queued[owner] = self._queued.get(owner, 0) + 1
        entry.task.add_done_callback(lambda _: self._finished(entry, request_id))
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
        task = self._entry(request_id, user=user).task
        assert task is not None, "an entry gets its task when it is submitted"
        if task.done():
            return task.result()
        done, _ = await asyncio.wait({task}, timeout=timeout)
        return task.result() if done else None

    def cancel(self, request_id: str, *, user: User) -> None:
        """Cancel a request (module doc); a finished one's result is dropped."""
        entry = self._entry(request_id, user=user)
        assert entry.task is not None, "an entry gets its task when it is submitted"
        if entry.task.done():
            self.forget(request_id, user=user)
            return
        entry.cancelled = True
        if isinstance(entry.started, asyncio.Future) and not entry.started.done():
            entry.started.cancel()  # a held sample: its start sees this and does nothing

    def forget(self, request_id: str, *, user: User) -> None:
        """Drop a finished request's result (its client has it); unknown ids are ignored."""
        entry = self._entries.get(request_id)
        if entry is None or not user.owns(entry.owner) or entry.finished_at is None:
            return
        del self._entries[request_id]
        if entry.key is not None:
            self._by_key.pop(entry.key, None)

    def _entry(self, request_id: str, *, user: User) -> _Entry:
        entry = self._entries.get(request_id)
        if entry is None or not user.owns(entry.owner):
            raise NotFound(
                f"unknown or expired request id {request_id!r} (results are kept "
                f"{self.result_ttl_s:g} s; a request of an ended session is dropped with it)"
            )
        return entry

    def close_queue(self, queue: str) -> None:
        """Forget a model's dispatcher; calls queued and not started are cancelled (their
        requests then fail), and its thread ends after the one running, if any."""
        dispatcher = self._dispatchers.pop(queue, None)
        if dispatcher is not None:
            dispatcher.close(wait=False, cancel_pending=True)

    def drop_scope(self, scope: str, *, sampling_session_ids: Sequence[str] = ()) -> None:
        """Cancel and forget the requests of an ended session (and its sampling sessions'
        feeds)."""
        self.feeds.drop_scope(scope, sampling_session_ids=list(sampling_session_ids))
        for request_id, entry in list(self._entries.items()):
            if entry.scope == scope:
                assert entry.task is not None, "an entry gets its task when it is submitted"
                entry.task.cancel()
                del self._entries[request_id]
                if entry.key is not None:
                    self._by_key.pop(entry.key, None)

    def _finished(self, entry: _Entry, request_id: str) -> None:
        entry.finished_at = time.monotonic()
        assert entry.task is not None, "an entry gets its task when it is submitted"
        if entry.feed is not None and not entry.task.cancelled():
            answer = entry.task.result()
            completion: tinker_types.FutureCompletion = (
                tinker_types.FutureFailed(request_id=request_id)
                if answer.failed
                else tinker_types.FutureFinished(
                    request_id=request_id, response_payload_uncompressed_size=len(answer.content)
                )
            )
            self.feeds.add(entry.feed, completion, owner=entry.owner, scope=entry.scope)
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
        self, entry: _Entry, encode: Callable[[Any], Answer], request_id: str
    ) -> Answer:
        try:
            value = entry.started
            while isinstance(value, APIFuture | asyncio.Future):
                value = await value
            if entry.cancelled:
                return failure(CANCELLED, category="user")  # it ran: its result is dropped
            return encode(value)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # this request is being dropped (its session ended)
            if entry.cancelled:
                return failure(CANCELLED, category="user")
            # A queued call cancelled because its model was released.
            return failure("request cancelled: its model was released", category="user")
        except _Cancelled:
            return failure(CANCELLED, category="user")
        except Exception as error:
            if entry.cancelled:
                return failure(CANCELLED, category="user")
            category = category_of(error)
            if category == "server":
                log.exception("request %s failed", request_id)
            else:
                log.info("request %s failed: %s", request_id, error)
            return failure(f"{type(error).__name__}: {error}", category=category)
        finally:
            # The answer is encoded: holding what the call returned (a sampling client, say)
            # would keep it alive, and what it holds (a snapshot's adapter), until the result
            # expires.
            entry.started = None

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
    body = json.dumps({"error": bounded(message), "category": category}).encode()
    return Answer(body, failed=True)


def _unless_cancelled(entry: _Entry, call: Callable[[], Any]) -> Callable[[], Any]:
    """`call`, skipped if its request was cancelled while it waited in its queue."""

    def run() -> Any:
        if entry.cancelled:
            raise _Cancelled
        return call()

    return run
