"""`temper plot RUN_DIR`: the figures of a run's metrics.jsonl and their index.html."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import tyro

from temper.observability import plot_metrics


def plot(
    run_dir: Annotated[Path, tyro.conf.Positional],
    /,
    *,
    out_dir: Path | None = None,
) -> int:
    """Write the figures of a run's metrics and an index.html showing them (default:
    RUN_DIR/plots); prints the paths written, the index last.

    Args:
        run_dir: A run directory holding metrics.jsonl.
        out_dir: Where to write the PNG files and index.html.
    """
    for path in plot_metrics(run_dir, out_dir=out_dir):
        print(path)
    return 0
