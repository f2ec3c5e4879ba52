"""CallBatches: calls from many threads run together, one batch at a time.

vLLM's multi-LoRA sampler (generator/vllm_lora.py) decodes the calls of many clients, each
on its own sampling worker thread (Temper's engine needs none of this: calls join its
running batch, sampler/decode_loop.py). A call that finds no batch running
leads the next one: it waits while other calls keep arriving (each within the batch window
of the last, ten windows at most), then runs every queued call as one batch. Calls that
arrive while a batch runs wait and form the following batch. Each call gets its own results
or its own error.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from temper.api.types import SampleResponse
from temper.sampler.requests import SampleRequest

Key = TypeVar("Key")


@dataclass(eq=False)
class Call(Generic[Key]):
    """One caller's requests and what its batch gives back (results or an error)."""

    requests: list[SampleRequest]
    key: Key
    """What the runner needs besides the requests (an adapter)."""
    results: list[SampleResponse] | None = field(default=None)
    error: BaseException | None = field(default=None)

    @property
    def done(self) -> bool:
        return self.results is not None or self.error is not None


class CallBatches(Generic[Key]):
    """Runs queued calls in batches through `run(calls)`, which sets each call's results or
    error (see the module docstring)."""

    def __init__(self, *, window_s: float, run: Callable[[list[Call[Key]]], None]) -> None:
        self._window_s = window_s
        self._run = run
        self._lock = threading.Condition()
        self._queue: list[Call[Key]] = []
        self._busy = False

    def call(self, requests: list[SampleRequest], *, key: Key) -> list[SampleResponse]:
        """`requests` run in the next batch; their results, or the error of this call."""
        call = Call(requests=requests, key=key)
        with self._lock:
            self._queue.append(call)
            self._lock.notify_all()  # a leader gathering callers counts this one
            while self._busy and not call.done:
                self._lock.wait()
            if not call.done:  # lead the next batch
                self._busy = True
                self._gather_callers()
                calls, self._queue = self._queue, []
            else:
                calls = []
        if calls:
            try:
                self._run(calls)
            finally:
                with self._lock:
                    self._busy = False
                    self._lock.notify_all()
        if call.error is not None:
            raise call.error
        assert call.results is not None
        return call.results

    def _gather_callers(self) -> None:
        """Wait while other calls keep arriving, each within the window of the last, up to
        ten windows in all (under the lock)."""
        window = self._window_s
        deadline = time.monotonic() + 10 * window
        while window > 0 and time.monotonic() < deadline:
            count = len(self._queue)
            self._lock.wait(min(window, deadline - time.monotonic()))
            if len(self._queue) == count:
                return
