"""`temper plot RUN_DIR`: PNG curves from a run's metrics.jsonl."""

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
    """Write PNG curves of a run's metrics (default: RUN_DIR/plots).

    Args:
        run_dir: A run directory holding metrics.jsonl.
        out_dir: Where to write the PNG files.
    """
    for path in plot_metrics(run_dir, out_dir=out_dir):
        print(path)
    return 0
