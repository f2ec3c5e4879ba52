"""Starting an RL batch's sample requests together, so the backend decodes them as one batch.

The SDK sends a batch's samples as separate HTTP requests, which reach the route one after
another as the event loop parses them (about a millisecond apart on an idle machine, tens of
milliseconds on a busy one). Started as they arrive, the first would decode alone while the
rest queue behind it. So a client's samples are held, then started back to back:

- as soon as the held samples fill the sampler's slots (`capacity` sequences): a sampler
  decodes at most that many at once, so a larger burst runs in waves anyway, and the first
  wave need not wait for the rest to arrive (they arrive while it decodes, and its answers go
  out while the next wave decodes);
- as soon as the burst reaches the usual size of its lineage's bursts (the same training
  model's snapshots, sampler checkpoint or base model): loops send the same number of samples
  every step. The usual size is the largest of the last `HISTORY` bursts. Until a burst
  reaches it, its samples wait (at most `max_hold_s`), however far apart they arrive;
- otherwise (a lineage's first burst, or a burst that grew past the usual size) after a quiet
  gap: each arrival pushes the start to `window_s` after itself, never past `max_hold_s`
  after the oldest held sample.

A burst is a client's samples that arrive less than `max_hold_s` apart; its size counts all of
them, however many starts it took, so a burst split by a slow moment still teaches the whole
size. A start runs inside the client's `batch()` block (`SamplingBackend.batch`: for the
in-process `SamplingClient`, the requests started together reach the engine as one batch
whatever the worker thread is doing, and their logprobs round the same way every time).
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from temper.api.backend import SamplingBackend

HISTORY = 4
"""Bursts per lineage whose largest size is the size to start at."""


@dataclass(eq=False)
class _Burst:
    lineage: Hashable
    last_arrival: float
    num_requests: int = 0
    """Requests in the whole burst so far, started or held."""
    held: list[Callable[[], None]] = field(default_factory=list)
    num_held_sequences: int = 0
    held_since: float = 0.0
    """Arrival of the oldest held request."""
    timer: asyncio.TimerHandle | None = None
    batch: Callable[[], contextlib.AbstractContextManager[None]] | None = None
    """The client's `batch` while requests are held (it holds the client, as they do)."""
    recorded: bool = False
    """In its lineage's history (from its first start on)."""


class SampleCoalescer:
    def __init__(self, window_s: float, *, max_hold_s: float, capacity: int | None = None) -> None:
        self.window_s = window_s
        self.max_hold_s = max_hold_s
        self.capacity = capacity
        """Sequences the sampler decodes at once; None: no limit."""
        self._bursts: weakref.WeakKeyDictionary[object, _Burst] = weakref.WeakKeyDictionary()
        """Client -> its current burst. Weak: holding a client would keep it alive, and the
        backend copies the weights for a live snapshot client when they change."""
        self._history: dict[Hashable, deque[_Burst]] = {}
        """Lineage -> its last `HISTORY` bursts that have started."""

    def add(
        self,
        client: SamplingBackend,
        start: Callable[[], None],
        *,
        lineage: Hashable,
        num_sequences: int = 1,
    ) -> None:
        """Hold `start` (which starts one request of `num_sequences` samples on `client`)."""
        now = asyncio.get_running_loop().time()
        burst = self._current_burst(client, lineage=lineage, now=now)
        if (
            self.capacity is not None
            and burst.held
            and burst.num_held_sequences + num_sequences > self.capacity
        ):
            self._start_held(burst)  # a full wave: this request opens the next one
        if not burst.held:
            burst.held_since = now
            burst.batch = client.batch
        burst.held.append(start)
        burst.num_held_sequences += num_sequences
        burst.num_requests += 1
        burst.last_arrival = now
        usual = self._usual_size(burst)
        full = self.capacity is not None and burst.num_held_sequences >= self.capacity
        if full or burst.num_requests == usual:
            self._start_held(burst)
        elif usual is not None and burst.num_requests < usual:
            self._start_at(burst, burst.held_since + self.max_hold_s)
        else:
            self._start_at(burst, min(now + self.window_s, burst.held_since + self.max_hold_s))

    def _current_burst(self, client: SamplingBackend, *, lineage: Hashable, now: float) -> _Burst:
        burst = self._bursts.get(client)
        if burst is not None and now - burst.last_arrival <= self.max_hold_s:
            return burst
        # Bursts over (nothing held, quiet for max_hold_s) no longer need an entry.
        for key, other in list(self._bursts.items()):
            if not other.held and now - other.last_arrival > self.max_hold_s:
                del self._bursts[key]
        burst = _Burst(lineage=lineage, last_arrival=now)
        self._bursts[client] = burst
        return burst

    def _usual_size(self, burst: _Burst) -> int | None:
        sizes = [
            other.num_requests
            for other in self._history.get(burst.lineage, ())
            if other is not burst
        ]
        return max(sizes, default=None)

    def _start_at(self, burst: _Burst, when: float) -> None:
        if burst.timer is not None:
            burst.timer.cancel()
        burst.timer = asyncio.get_running_loop().call_at(when, self._start_held, burst)

    def _start_held(self, burst: _Burst) -> None:
        if burst.timer is not None:
            burst.timer.cancel()
            burst.timer = None
        if not burst.recorded:
            burst.recorded = True
            self._history.setdefault(burst.lineage, deque(maxlen=HISTORY)).append(burst)
        starts, burst.held, burst.num_held_sequences = burst.held, [], 0
        batch, burst.batch = burst.batch, None
        assert batch is not None, "a burst with held requests holds its client's batch"
        with batch():
            for start in starts:
                start()
