"""RL jobs in the distributed tests: without plots (matplotlib costs seconds and is not under
test), on a spawned rank or in this process."""

from __future__ import annotations

from temper.job import run_checkpoints
from temper.rl.job import RLJob
from temper.rl.loop_state import RLResult


def no_plots(run_dir):
    return [run_dir / "plots" / "none.png"]


def skip_plots() -> None:
    """On a spawned rank (its own process): no plots for the rest of its life."""
    run_checkpoints.plot_metrics = no_plots


def run_in_process(config: RLJob.Config, run_dir) -> RLResult:
    """`config`'s job in this process, without plots."""
    original = run_checkpoints.plot_metrics
    run_checkpoints.plot_metrics = no_plots
    try:
        return RLJob(config).run(run_dir=run_dir)
    finally:
        run_checkpoints.plot_metrics = original
