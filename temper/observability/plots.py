"""PNG figures of a run's metrics.jsonl, one per question (figures.py), and an index.html.

Written to `out_dir` (default `<run dir>/plots`): `<figure>.png` for each figure worth drawing
(`learning`, `sampling`, `rollouts`, `optimizer`, `time`, `router`, `other`; see figures.py)
and
`index.html`, which shows them in reading order, each under its question and a one-line caption.

How a panel is drawn: x is the run's step; dense noisy series are drawn faint with a moving
average over them (computed within each phase, so the warm-up does not bleed into RL);
schedules and sparse evaluations are drawn raw, with markers when there are few points;
per-layer metrics are a heatmap, a row per layer and a colour bar for the value.
Fractions get a 0..1 axis; a linear axis never narrows below 5% of the values' size, so noise
does not fill it; wide positive ranges (losses, mismatch) get a log axis. The SFT warm-up of a
run with one is shaded and both phases are labelled.

Figures are built on `matplotlib.figure.Figure` directly, never through pyplot, so plotting
touches no global backend or figure state and works in headless jobs and threads. Files of an
earlier layout already in `out_dir` are left alone; the index names only what this call wrote.
"""

from __future__ import annotations

import html
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from temper.observability.figures import FigureSpec, PanelSpec, RunPhase, figure_specs
from temper.observability.metrics import METRICS_FILE_NAME, read_metrics
from temper.observability.series import Series, ema, metric_series

INDEX_FILE_NAME = "index.html"
# Smooth only when there are enough points for a trend to hide in the noise.
MIN_POINTS_TO_SMOOTH = 30
MAX_POINTS_WITH_MARKERS = 60
LOG_SCALE_RATIO = 100.0
"""A log axis when the largest value is this many times the smallest (all positive)."""
MIN_RELATIVE_SPAN = 0.05
PANEL_INCHES = (4.6, 3.3)


def plot_metrics(
    source: Path | str,
    *,
    out_dir: Path | str | None = None,
    keys: Sequence[str] | None = None,
) -> list[Path]:
    """Write the figures for the metrics in `source` (a run dir or a metrics.jsonl path) and
    their index.html.

    `keys` restricts the figures to those metric names. Returns the written paths: the PNGs in
    reading order, then the index.
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
    specs = figure_specs(series)
    written = []
    for spec in specs:
        figure = draw_figure(spec, series)
        figure.savefig(out_dir / f"{spec.name}.png", dpi=100)
        written.append(out_dir / f"{spec.name}.png")
    index = out_dir / INDEX_FILE_NAME
    index.write_text(index_html(specs, title=path.parent.name), encoding="utf-8")
    return [*written, index]


def draw_figure(spec: FigureSpec, series: Mapping[str, Series]) -> Any:
    """The `matplotlib.figure.Figure` of `spec`, drawn from `series` (name -> points)."""
    from matplotlib.figure import Figure

    num_panels = len(spec.panels)
    num_cols = num_panels if num_panels <= 3 else (2 if num_panels == 4 else 3)
    num_rows = math.ceil(num_panels / num_cols)
    figure = Figure(
        figsize=(PANEL_INCHES[0] * num_cols, PANEL_INCHES[1] * num_rows + 0.4),
        layout="constrained",
    )
    figure.suptitle(spec.title, fontsize=13, fontweight="bold")
    all_axes = figure.subplots(num_rows, num_cols, squeeze=False).flatten()
    for axes, panel in zip(all_axes, spec.panels, strict=False):
        _draw_panel(axes, panel, series, phases=spec.phases)
    for axes in all_axes[num_panels:]:
        axes.set_visible(False)
    return figure


def index_html(specs: Sequence[FigureSpec], *, title: str) -> str:
    """A page showing every figure of `specs` (by relative link) under its question."""
    sections = [
        f"<section>\n<h2>{html.escape(spec.title)}</h2>\n<p>{html.escape(spec.caption)}</p>\n"
        f'<img src="{html.escape(spec.name)}.png" alt="{html.escape(spec.title)}">\n</section>'
        for spec in specs
    ]
    return "\n".join(
        [
            "<!doctype html>",
            '<html lang="en">',
            '<head><meta charset="utf-8">',
            f"<title>{html.escape(title)}: plots</title>",
            "<style>body { font-family: sans-serif; max-width: 1400px; margin: 1em auto; } "
            "img { max-width: 100%; } p { color: #444; }</style>",
            "</head>",
            "<body>",
            f"<h1>{html.escape(title)}</h1>",
            *sections,
            "</body>",
            "</html>",
            "",
        ]
    )


def _draw_panel(
    axes: Any, panel: PanelSpec, series: Mapping[str, Series], *, phases: Sequence[RunPhase]
) -> None:
    if panel.heatmap:
        _draw_heatmap(axes, panel, series, phases=phases)
        return
    drawn: list[Series] = []
    for index, line in enumerate(panel.lines):
        points = series[line.key]
        if panel.phase is not None:
            points = _between(points, panel.phase.first_step, panel.phase.last_step)
        label = line.label if len(panel.lines) > 1 else None
        if line.smooth:
            _draw_smoothed(axes, points, phases=phases, color=f"C{index}", label=label)
        else:
            _draw_raw(axes, points, color=f"C{index}", label=label)
        drawn.append(points)
    steps = [step for points in drawn for step in points.steps]
    values = [value for points in drawn for value in points.values]
    _mark_phases(axes, phases, first_step=min(steps), last_step=max(steps))
    _scale_y(axes, panel, values)
    axes.set_title(panel.title, fontsize=10)
    axes.set_xlabel("step")
    axes.set_ylabel(panel.ylabel)
    axes.grid(alpha=0.3)
    if len(panel.lines) > 1:
        axes.legend(fontsize=8)


def _draw_heatmap(
    axes: Any, panel: PanelSpec, series: Mapping[str, Series], *, phases: Sequence[RunPhase]
) -> None:
    """The lines as rows over the steps any of them logged (blank where one did not), with
    the phases' boundaries dashed."""
    steps = sorted({step for line in panel.lines for step in series[line.key].steps})
    column = {step: index for index, step in enumerate(steps)}
    values = [[math.nan] * len(steps) for _ in panel.lines]
    for row, line in enumerate(panel.lines):
        points = series[line.key]
        for step, value in zip(points.steps, points.values, strict=True):
            values[row][column[step]] = value
    # Cell edges halfway between logged steps, so uneven logging keeps its place on the axis.
    middles = [(a + b) / 2 for a, b in itertools.pairwise(steps)]
    edges = [steps[0] - 0.5, *middles, steps[-1] + 0.5]
    mesh = axes.pcolormesh(edges, range(len(panel.lines) + 1), values, cmap="viridis")
    axes.figure.colorbar(mesh, ax=axes)
    every = max(1, math.ceil(len(panel.lines) / 12))  # at most about 12 labelled rows
    rows = range(0, len(panel.lines), every)
    axes.set_yticks([row + 0.5 for row in rows], [panel.lines[row].label for row in rows])
    axes.invert_yaxis()  # the first layer on top
    for phase in phases[1:]:
        if steps[0] < phase.first_step <= steps[-1]:
            axes.axvline(phase.first_step, color="white", linestyle="--", linewidth=0.8)
    axes.set_title(panel.title, fontsize=10)
    axes.set_xlabel("step")
    axes.set_ylabel(panel.ylabel)


def _draw_smoothed(
    axes: Any, points: Series, *, phases: Sequence[RunPhase], color: str, label: str | None
) -> None:
    """Raw values faint and a moving average per phase, when there are enough points."""
    if len(points.steps) < MIN_POINTS_TO_SMOOTH:
        _draw_raw(axes, points, color=color, label=label)
        return
    axes.plot(points.steps, points.values, color=color, alpha=0.25, linewidth=0.8)
    for segment in _split_at_phases(points, phases):
        smoothed = ema(segment.values, num_points=len(segment.values))
        axes.plot(segment.steps, smoothed, color=color, linewidth=1.6, label=label)
        label = None  # one legend entry per line


def _draw_raw(axes: Any, points: Series, *, color: str, label: str | None) -> None:
    if len(points.steps) <= MAX_POINTS_WITH_MARKERS:
        style = {"marker": "o", "markersize": 4, "linewidth": 1.0}
    else:
        style = {"linewidth": 1.4}
    if len(points.steps) == 1:
        style = {"marker": "*", "markersize": 10, "linestyle": "none"}
    axes.plot(points.steps, points.values, color=color, label=label, **style)


def _mark_phases(axes: Any, phases: Sequence[RunPhase], *, first_step: int, last_step: int) -> None:
    """Shade every other phase and label each, within the panel's own steps only (a panel of
    RL metrics is not stretched over the warm-up); nothing on a panel within one phase."""
    width = last_step - first_step
    overlapping = [p for p in phases if p.first_step <= last_step and first_step <= p.last_step]
    if width <= 0 or len(overlapping) < 2:
        return
    for index, phase in enumerate(phases):
        start, end = max(phase.first_step, first_step), min(phase.last_step, last_step)
        if start > end:
            continue
        if index % 2 == 0:
            axes.axvspan(start, end, color="0.5", alpha=0.1, linewidth=0)
        if index > 0 and start == phase.first_step:
            axes.axvline(start, color="0.4", linestyle="--", linewidth=0.8)
        if (end - start) / width >= 0.05:
            axes.text(
                start + 0.01 * width,
                0.97,
                phase.name,
                transform=axes.get_xaxis_transform(),
                fontsize=8,
                color="0.3",
                va="top",
                bbox={"facecolor": "white", "alpha": 0.7, "edgecolor": "none", "pad": 1.5},
            )


def _scale_y(axes: Any, panel: PanelSpec, values: Sequence[float]) -> None:
    low, high = min(values), max(values)
    if panel.unit_range and low >= 0.0 and high <= 1.0:
        axes.set_ylim(-0.03, 1.03)
        return
    if panel.log_y and low > 0 and high / low >= LOG_SCALE_RATIO:
        axes.set_yscale("log")
        return
    axes.ticklabel_format(axis="y", useOffset=False)
    floor = MIN_RELATIVE_SPAN * max(abs(low), abs(high))
    if high - low < floor:
        center = (low + high) / 2
        axes.set_ylim(center - floor, center + floor)


def _between(points: Series, first_step: int, last_step: int) -> Series:
    return _where(points, lambda step: first_step <= step <= last_step)


def _split_at_phases(points: Series, phases: Sequence[RunPhase]) -> list[Series]:
    edges = [-math.inf, *(phase.first_step for phase in phases[1:]), math.inf]
    segments = [
        _where(points, lambda step, low=low, high=high: low <= step < high)
        for low, high in itertools.pairwise(edges)
    ]
    return [segment for segment in segments if segment.steps]


def _where(points: Series, keep: Callable[[int], bool]) -> Series:
    pairs = [(s, v) for s, v in zip(points.steps, points.values, strict=True) if keep(s)]
    return Series(steps=[s for s, _ in pairs], values=[v for _, v in pairs])
