"""Futures for the client API: `.result()` to block, `await` or `.result_async()` in asyncio.

Each training model runs its requests on one worker thread, in submission order (Tinker's
ordering contract); a future resolves when its request has run.

Requests that batch well (sampling) can be coalesced: everything submitted with the same key
between two ordinary calls runs as one batch, at the position of the first of them. An
ordinary call (a training step) starts a new epoch, so a sample submitted after an optimizer
step is never answered with the weights from before it.

Where one batch ends is a matter of timing: a batch runs as soon as the worker thread is free,
so of several requests sent one after another, the first may run alone while the others are
still being sent. The engine's results for a request depend on its batch at rounding level (on
CPU a matmul may round a row differently with 1-7 rows than with 8 or more), so a caller that needs
reproducible results (a seeded RL step, a resumed run that must equal an uninterrupted one)
sends its requests inside `Worker.batch()`: they are held until the block ends and then run as
one batch per key, however the threads are scheduled.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Callable, Generator, Hashable, Iterator, Sequence
from typing import Any, Generic, TypeVar

from temper.api.threads import ThreadSettings

T = TypeVar("T")


class APIFuture(Generic[T]):
    def __init__(self, future: concurrent.futures.Future[T]) -> None:
        self._future = future

    def result(self, timeout: float | None = None) -> T:
        return self._future.result(timeout)

    async def result_async(self, timeout: float | None = None) -> T:
        return await asyncio.wait_for(asyncio.wrap_future(self._future), timeout)

    def done(self) -> bool:
        return self._future.done()

    def add_done_callback(self, fn: Callable[[APIFuture[T]], None]) -> None:
        """Call `fn(self)` once the request has run (at once if it already has), on the
        thread that finished it: keep `fn` short (e.g. put the future on a queue)."""
        self._future.add_done_callback(lambda _: fn(self))

    def __await__(self) -> Generator[Any, None, T]:
        return self.result_async().__await__()


class Worker:
    """One thread that runs submitted calls in order; with `max_workers` > 1, that many,
    so that calls start in order and a later one may run while an earlier one does (a
    sampling client whose engine lets calls join its running batch)."""

    def __init__(self, name: str, *, max_workers: int = 1) -> None:
        # The thread takes the creator's torch thread count (pinned, so that the rounding of
        # its results does not depend on what others set meanwhile) and CUDA device (a rank's
        # own GPU, not cuda:0): threads.py.
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=max_workers,
            thread_name_prefix=name,
            initializer=ThreadSettings.of_caller().apply,
        )
        self._lock = threading.Lock()
        self._epoch = 0
        self._pending: dict[tuple[Hashable, int], list[tuple[Any, concurrent.futures.Future]]] = {}
        self._num_holds = 0
        self._held: list[tuple[tuple[Hashable, int], Callable]] = []
        """Batches sent inside `batch()` blocks, in order; they run when the last block ends."""

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> APIFuture[T]:
        with self._lock:
            self._release_held()  # batches sent before this call run before it
            self._epoch += 1
            return APIFuture(self._executor.submit(fn, *args, **kwargs))

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Items `submit_batched` inside the block run as one batch per key once it ends,
        whatever the timing (not a first item alone because the worker was free). Blocks
        nest, also across threads (the last open block's end releases: keep blocks short, as
        items other threads send meanwhile wait too), and an ordinary `submit` releases
        what was sent before it, to keep the order. Do not wait for a held item's result
        inside the block: it runs only after the block. Items sent just before or after the
        block never join its batches."""
        with self._lock:
            if self._num_holds == 0:
                self._epoch += 1
            self._num_holds += 1
        try:
            yield
        finally:
            with self._lock:
                self._num_holds -= 1
                if self._num_holds == 0:
                    self._release_held()
                    self._epoch += 1

    def submit_batched(
        self, key: Hashable, item: Any, run_batch: Callable[[Sequence[Any]], list[Any]]
    ) -> APIFuture:
        """Queue `item`; items with the same key in the same epoch run in one `run_batch`."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            slot = (key, self._epoch)
            batch = self._pending.setdefault(slot, [])
            batch.append((item, future))
            if len(batch) == 1:
                if self._num_holds:
                    self._held.append((slot, run_batch))
                else:
                    self._executor.submit(self._flush, slot, run_batch)
        return APIFuture(future)

    def _release_held(self) -> None:
        """Queue the held batches (the caller holds the lock)."""
        for slot, run_batch in self._held:
            self._executor.submit(self._flush, slot, run_batch)
        self._held.clear()

    def _flush(self, slot: tuple[Hashable, int], run_batch: Callable) -> None:
        with self._lock:
            batch = self._pending.pop(slot)
        try:
            results = run_batch([item for item, _ in batch])
        except Exception:
            # One bad item must not fail the others: run them one at a time for exact answers.
            for item, future in batch:
                _settle(future, run_batch, item)
            return
        for (_, future), result in zip(batch, results, strict=True):
            future.set_result(result)

    def close(self, *, wait: bool = True, cancel_pending: bool = False) -> None:
        """Stop taking calls; with `cancel_pending`, calls not started yet are cancelled
        (their futures raise CancelledError); with `wait`, block until the rest have run."""
        self._executor.shutdown(wait=wait, cancel_futures=cancel_pending)


def _settle(future: concurrent.futures.Future, run_batch: Callable, item: Any) -> None:
    try:
        future.set_result(run_batch([item])[0])
    except Exception as error:
        future.set_exception(error)
