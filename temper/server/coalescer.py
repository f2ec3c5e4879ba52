"""Starting an RL batch's sample requests together, so the backend decodes them as one batch.

The SDK sends a batch's samples as separate HTTP requests, which reach the route one after
another as the event loop parses them (about a millisecond apart on a busy machine). Started
as they arrive, the first would decode alone while the rest queue behind it. So each sample
is held until its client's burst is over, then the burst starts back to back:

- a burst is over after a quiet gap: each arrival pushes the flush to `window_s` after itself,
  but never past `max_hold_s` after the burst's first arrival;
- or as soon as it reaches the usual size of its lineage's bursts (the same training model's
  snapshots, sampler checkpoint or base model): loops send the same number of samples every
  step, and waiting out the gap would only add latency. The usual size is the largest of the
  last `HISTORY` bursts, so a burst that a slow moment split in two does not lower it. If a
  burst turns out larger (more samples arrive within `window_s` of such an early start), the
  rest start as a second batch and the larger size is expected from then on.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

HISTORY = 4
"""Bursts per lineage whose largest size is the size to start at."""


@dataclass
class _Burst:
    lineage: Hashable
    deadline: float
    carried: int
    """Samples of the same burst already started early (it grew past the usual size)."""
    starts: list[Callable[[], None]] = field(default_factory=list)
    timer: asyncio.TimerHandle | None = None


class SampleCoalescer:
    def __init__(self, window_s: float, *, max_hold_s: float) -> None:
        self.window_s = window_s
        self.max_hold_s = max_hold_s
        self._pending: dict[int, _Burst] = {}
        self._sizes: dict[Hashable, deque[int]] = {}
        """Lineage -> sizes of its last `HISTORY` whole bursts."""
        self._early: dict[int, tuple[float, int]] = {}
        """Client -> (when, how many) of its last burst started early, at the usual size."""

    def add(self, client: object, start: Callable[[], None], *, lineage: Hashable) -> None:
        """Hold `start` (which starts one sample on `client`) until the burst is over."""
        key = id(client)
        loop = asyncio.get_running_loop()
        now = loop.time()
        burst = self._pending.get(key)
        if burst is None:
            started_early, carried = self._early.pop(key, (0.0, 0))
            if now - started_early > self.window_s:
                carried = 0
            burst = _Burst(lineage=lineage, deadline=now + self.max_hold_s, carried=carried)
            self._pending[key] = burst
        else:
            burst.timer.cancel()
        burst.starts.append(start)
        size = burst.carried + len(burst.starts)
        sizes = self._sizes.get(lineage)
        if sizes and size == max(sizes):
            self._early = {k: v for k, v in self._early.items() if now - v[0] <= self.window_s}
            self._early[key] = (now, size)
            self._flush(key)
            return
        burst.timer = loop.call_at(min(now + self.window_s, burst.deadline), self._flush, key)

    def _flush(self, key: int) -> None:
        burst = self._pending.pop(key)
        sizes = self._sizes.setdefault(burst.lineage, deque(maxlen=HISTORY))
        sizes.append(burst.carried + len(burst.starts))
        for start in burst.starts:
            start()
