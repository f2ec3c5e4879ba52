"""PNG curves of a run's metrics.jsonl: one figure per metric group plus overlay figures.

Figures are built on `matplotlib.figure.Figure` directly, never through pyplot, so plotting
touches no global backend or figure state and works in headless jobs and threads.

Files written to `out_dir` (default `<run dir>/plots`):
- `<group>.png` per group (the name before the first '/', `metrics` for names without one), one
  subplot per metric;
- `reward.png`, `accuracy.png`, `loss.png`: every metric whose name contains that word,
  overlaid on one axes (e.g. train and eval loss together). A group with one of these names is
  written as `<group>_group.png` instead.

When a resumed run re-logs steps it already logged (it restarted from an earlier checkpoint),
the later records replace the earlier ones from that step on.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from temper.observability.metrics import METRICS_FILE_NAME, RESERVED_KEYS, read_metrics

OVERLAY_WORDS = ("reward", "accuracy", "loss")
UNGROUPED = "metrics"
# Smooth only when there are enough points for a trend to hide in the noise.
MIN_POINTS_TO_SMOOTH = 30
SUBPLOT_INCHES = (4.0, 3.0)


@dataclasses.dataclass
class Series:
    """The logged points of one metric, in step order; null (non-finite) values are left out."""

    steps: list[int]
    values: list[float]


def plot_metrics(
    source: Path | str,
    *,
    out_dir: Path | str | None = None,
    keys: Sequence[str] | None = None,
) -> list[Path]:
    """Write PNG curves for the metrics in `source` (a run dir or a metrics.jsonl path).

    `keys` restricts the plots to those metric names. Returns the written paths.
    """
    source = Path(source)
    path = source / METRICS_FILE_NAME if source.is_dir() else source
    if not path.is_file():
        raise FileNotFoundError(f"no metrics file at {path}")
    series = metric_series(read_metrics(path))
    if not series:
        raise ValueError(f"metrics file {path} has no metric values to plot")
    if keys is not None:
        unknown = [key for key in keys if key not in series]
        if unknown:
            raise ValueError(
                f"keys {unknown} are not in {path}; available metrics: {sorted(series)}"
            )
        series = {key: series[key] for key in keys}
    out_dir = Path(out_dir) if out_dir is not None else path.parent / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)

    groups: dict[str, dict[str, Series]] = {}
    for name in sorted(series):
        group = name.partition("/")[0] if "/" in name else UNGROUPED
        groups.setdefault(group, {})[name] = series[name]
    written = []
    for group, members in sorted(groups.items()):
        file_stem = f"{group}_group" if group in OVERLAY_WORDS else group
        written.append(_save_grid(members, out_dir / f"{_safe_file_stem(file_stem)}.png"))
    for word in OVERLAY_WORDS:
        members = {name: s for name, s in series.items() if word in name.lower()}
        if members:
            written.append(_save_overlay(members, title=word, path=out_dir / f"{word}.png"))
    return written


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


def _draw(axes: Any, name: str, points: Series, *, color: str, label: bool) -> None:
    smooth = len(points.steps) >= MIN_POINTS_TO_SMOOTH
    raw_style = {"alpha": 0.3, "linewidth": 0.8} if smooth else {"marker": "o", "markersize": 3}
    axes.plot(
        points.steps,
        points.values,
        color=color,
        label=name if label and not smooth else None,
        **raw_style,
    )
    if smooth:
        smoothed = ema(points.values, num_points=len(points.values))
        axes.plot(points.steps, smoothed, color=color, linewidth=1.6, label=name if label else None)


def _save_grid(members: dict[str, Series], path: Path) -> Path:
    from matplotlib.figure import Figure

    num_cols = min(3, len(members))
    num_rows = math.ceil(len(members) / num_cols)
    figure = Figure(
        figsize=(SUBPLOT_INCHES[0] * num_cols, SUBPLOT_INCHES[1] * num_rows), layout="constrained"
    )
    all_axes = figure.subplots(num_rows, num_cols, squeeze=False).flatten()
    for axes, (name, points) in zip(all_axes, members.items(), strict=False):
        _draw(axes, name, points, color="C0", label=False)
        axes.set_title(name, fontsize=10)
        axes.set_xlabel("step")
        axes.grid(alpha=0.3)
    for axes in all_axes[len(members) :]:
        axes.set_visible(False)
    figure.savefig(path, dpi=100)
    return path


def _save_overlay(members: dict[str, Series], *, title: str, path: Path) -> Path:
    from matplotlib.figure import Figure

    figure = Figure(
        figsize=(SUBPLOT_INCHES[0] * 1.5, SUBPLOT_INCHES[1] * 1.5), layout="constrained"
    )
    axes = figure.subplots()
    for index, (name, points) in enumerate(sorted(members.items())):
        _draw(axes, name, points, color=f"C{index % 10}", label=True)
    axes.set_title(title)
    axes.set_xlabel("step")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.savefig(path, dpi=100)
    return path


def _safe_file_stem(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)
