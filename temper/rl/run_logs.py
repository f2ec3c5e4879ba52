"""A run's per-step logs: metrics.jsonl and rollouts.jsonl, written by the writer rank (rank 0)
only, and cut back to the last checkpoint when a stopped run resumes."""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import IO

from rich.console import Console

from temper.checkpoint.run_state import truncate_jsonl
from temper.distributed.ranks import Ranks
from temper.observability import MetricsLogger
from temper.observability.metrics import METRICS_FILE_NAME

ROLLOUTS_FILE_NAME = "rollouts.jsonl"


def truncate_logs(run_dir: Path, *, before_step: int) -> None:
    """Cut the per-step logs a stopped run wrote after its last checkpoint."""
    for name in (METRICS_FILE_NAME, ROLLOUTS_FILE_NAME):
        truncate_jsonl(run_dir / name, before_step=before_step)


def metrics_logger(
    config: MetricsLogger.Config, *, ranks: Ranks, run_dir: Path, total_steps: int
) -> MetricsLogger:
    """Rank 0's logger writes and shows; the other ranks' log the same metrics silently."""
    console = None
    if not ranks.is_writer:
        config = dataclasses.replace(
            config, display="none", jsonl=False, tensorboard=False, progress_keys=()
        )
        console = Console(quiet=True)
    return MetricsLogger(
        config, run_dir=run_dir, total_steps=total_steps, description="GRPO", console=console
    )


def open_rollouts(
    run_dir: Path, *, ranks: Ranks
) -> contextlib.AbstractContextManager[IO[str] | None]:
    """rollouts.jsonl, opened for appending on rank 0; None on the others."""
    if not ranks.is_writer:
        return contextlib.nullcontext(None)
    return (run_dir / ROLLOUTS_FILE_NAME).open("a")
