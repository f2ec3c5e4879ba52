"""Wall-clock time per named phase of a training step, as metrics ready for `MetricsLogger`.

    timer = PhaseTimer()
    for step in range(num_steps):
        with timer.phase("sample"):
            ...
        with timer.phase("train"):
            ...
        logger.log(step, {**train_metrics, **timer.collect()})

Times are host wall-clock seconds (`time.perf_counter`). CUDA work is asynchronous, so a phase
that only launches kernels looks fast unless the caller synchronizes inside it; this module does
not synchronize for you.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

TOTAL_KEY = "total"


class PhaseTimer:
    """Accumulates seconds per phase name until `collect()` hands them out and starts over."""

    def __init__(
        self, *, prefix: str = "time/", clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self.prefix = prefix
        self._clock = clock
        self._seconds: dict[str, float] = {}
        self._open: set[str] = set()
        self._step_start = clock()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the body under `name`; repeated phases in one step add up, nesting is allowed."""
        if not isinstance(name, str) or not name or name == TOTAL_KEY:
            raise ValueError(
                f"phase name {name!r} is invalid: use a non-empty string other than {TOTAL_KEY!r}"
                f" (collect() reports the whole step as {self.prefix}{TOTAL_KEY})"
            )
        if name in self._open:
            raise ValueError(f"phase {name!r} is already running; it would be counted twice")
        self._open.add(name)
        start = self._clock()
        try:
            yield
        finally:
            # Count the time even when the body raises, so a failed step still shows its cost.
            self._seconds[name] = self._seconds.get(name, 0.0) + self._clock() - start
            self._open.discard(name)

    def collect(self) -> dict[str, float]:
        """Seconds per phase since the last `collect()`, plus `<prefix>total` for the whole
        interval (timed or not), then start the next interval."""
        if self._open:
            raise RuntimeError(f"collect() called while phases {sorted(self._open)} are running")
        now = self._clock()
        metrics = {f"{self.prefix}{name}": seconds for name, seconds in self._seconds.items()}
        metrics[f"{self.prefix}{TOTAL_KEY}"] = now - self._step_start
        self._seconds = {}
        self._step_start = now
        return metrics


def tokens_per_second(num_tokens: int, *, seconds: float) -> float:
    """Throughput of `num_tokens` processed in `seconds` (e.g. a phase time from `collect()`)."""
    if seconds <= 0:
        raise ValueError(f"seconds={seconds!r} must be > 0 to compute a throughput")
    return num_tokens / seconds
