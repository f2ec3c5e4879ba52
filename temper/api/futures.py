"""Futures for the client API: `.result()` to block, `await` or `.result_async()` in asyncio.

Each training model runs its requests on one worker thread, in submission order (Tinker's
ordering contract); a future resolves when its request has run.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Generator
from typing import Any, Generic, TypeVar

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

    def __await__(self) -> Generator[Any, None, T]:
        return self.result_async().__await__()


class Worker:
    """One thread that runs submitted calls in order."""

    def __init__(self, name: str) -> None:
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=name
        )

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> APIFuture[T]:
        return APIFuture(self._executor.submit(fn, *args, **kwargs))

    def close(self) -> None:
        self._executor.shutdown(wait=True)
