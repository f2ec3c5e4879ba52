"""cancel_future's semantics in the scheduler: a queued call cancelled before its turn never
runs, a running one finishes and its result is dropped, a held sample is never started, and
the sampling feed reports each finished request once (no server, no model: plain calls)."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from temper.server.dispatch.scheduler import CANCELLED, Answer, Scheduler
from temper.server.http.errors import NotFound
from temper.server.http.users import User

ALICE = User("alice")


def encode(value) -> Answer:
    return Answer(json.dumps(value).encode())


async def settle(scheduler: Scheduler, request_id: str) -> dict:
    answer = await scheduler.retrieve(request_id, user=ALICE, timeout=30)
    assert answer is not None
    return json.loads(answer.content)


def test_a_queued_call_never_runs_and_a_running_one_is_dropped():
    async def main() -> None:
        scheduler = Scheduler()
        release, ran = threading.Event(), []

        def running() -> str:
            ran.append("running")
            release.wait(30)
            return "first"

        def queued() -> str:
            ran.append("queued")
            return "second"

        def submit(call) -> str:
            return scheduler.submit(call, encode=encode, owner="alice", scope="s", queue="m")

        first, second = submit(running), submit(queued)
        third = submit(lambda: "third")
        while not ran:  # the first call is running on the model's queue
            await asyncio.sleep(0.01)
        scheduler.cancel(first, user=ALICE)
        scheduler.cancel(second, user=ALICE)
        release.set()
        assert CANCELLED in (await settle(scheduler, first))["error"]
        assert CANCELLED in (await settle(scheduler, second))["error"]
        assert await settle(scheduler, third) == "third"
        assert ran == ["running"]  # the cancelled queued call never ran

    asyncio.run(main())


def test_a_held_sample_is_never_started_and_the_feed_reports_finished_ones():
    async def main() -> None:
        scheduler = Scheduler()
        held = asyncio.get_running_loop().create_future()
        ready = asyncio.get_running_loop().create_future()
        target = ("samp-1", 0)
        cancelled = scheduler.submit(
            lambda: held, encode=encode, owner="alice", scope="s", feed=target
        )
        done = scheduler.submit(lambda: ready, encode=encode, owner="alice", scope="s", feed=target)
        scheduler.cancel(cancelled, user=ALICE)
        assert held.cancelled()  # the coalescer's start sees this and does nothing
        ready.set_result([1, 2])
        feeds = scheduler.feeds
        feeds.open(target, owner="alice", scope="s")
        seen: dict[str, str] = {}
        cursor = 0
        while len(seen) < 2:
            completions, cursor = await feeds.poll(target, after=cursor, timeout=5)
            seen |= {c.request_id: c.state for c in completions}
        assert seen == {cancelled: "failed", done: "finished"}
        assert (await feeds.poll(target, after=cursor, timeout=0))[0] == []
        scheduler.forget(done, user=ALICE)  # retrieved: its result is dropped
        with pytest.raises(NotFound):
            await scheduler.retrieve(done, user=ALICE, timeout=0)
        assert scheduler.feeds.join("samp-1") == 1 and scheduler.feeds.join("samp-1") == 2

    asyncio.run(main())
