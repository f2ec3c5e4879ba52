"""Observability: per-step metrics (console, metrics.jsonl, TensorBoard), plots and timers.

Importing this package does not import matplotlib or TensorBoard; they load when used.
"""

from __future__ import annotations

from temper.observability.figures import FigureSpec, figure_specs
from temper.observability.metrics import (
    MetricsLogger,
    format_value,
    read_metrics,
    summary_panel,
)
from temper.observability.plots import draw_figure, plot_metrics
from temper.observability.series import Series, metric_series
from temper.observability.timing import PhaseTimer, tokens_per_second

__all__ = [
    "FigureSpec",
    "MetricsLogger",
    "PhaseTimer",
    "Series",
    "draw_figure",
    "figure_specs",
    "format_value",
    "metric_series",
    "plot_metrics",
    "read_metrics",
    "summary_panel",
    "tokens_per_second",
]
