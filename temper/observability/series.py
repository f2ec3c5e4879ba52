"""A run's metrics as one series of (step, value) points per metric, from metrics.jsonl records.

When a resumed run re-logs steps it already logged (it restarted from an earlier checkpoint),
the later records replace the earlier ones from that step on. Null (non-finite) values are left
out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from temper.observability.metrics import RESERVED_KEYS


@dataclasses.dataclass
class Series:
    """The logged points of one metric, in step order; null (non-finite) values are left out."""

    steps: list[int]
    values: list[float]


def metric_series(records: Sequence[dict[str, Any]]) -> dict[str, Series]:
    """Collect each metric's (step, value) points from metrics.jsonl records, in file order."""
    series: dict[str, Series] = {}
    previous_step = -1
    for record in records:
        step = record["step"]
        if step < previous_step:
            # The run resumed from an earlier checkpoint: the newer timeline wins for every
            # metric, including ones this record does not carry.
            for points in series.values():
                _drop_from(points, step)
        previous_step = step
        for name, value in record.items():
            if name in RESERVED_KEYS:
                continue
            points = series.setdefault(name, Series(steps=[], values=[]))
            _drop_from(points, step)  # the same metric logged twice at one step: keep the last
            if value is not None:
                points.steps.append(step)
                points.values.append(float(value))
    return {name: points for name, points in series.items() if points.steps}


def ema(values: Sequence[float], *, num_points: int) -> list[float]:
    """Bias-corrected exponential moving average with a span of about 5% of `num_points`."""
    span = max(2, num_points // 20)
    decay = 1.0 - 2.0 / (span + 1)
    smoothed, average = [], 0.0
    for index, value in enumerate(values, start=1):
        average = decay * average + (1.0 - decay) * value
        smoothed.append(average / (1.0 - decay**index))
    return smoothed


def _drop_from(points: Series, step: int) -> None:
    while points.steps and points.steps[-1] >= step:
        points.steps.pop()
        points.values.pop()
