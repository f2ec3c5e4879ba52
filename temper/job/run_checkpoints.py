"""A run's checkpoints, shared by the RL and SFT jobs: resumable states while it trains, the
final sampler weights and the closing report when it ends.

Every `every` steps and after the last one, `step_done` saves the training client's full state
(`save_state`: model and optimizer, written by all ranks together) and then, on rank 0, the
run state that names it plus the job's loop state (temper/checkpoint/run_state.py), and drops
the previous checkpoint: the run directory holds only the last one, and a crash at any moment
leaves one that `temper train --resume` continues from. The loop state is the job's own
dataclass (`RLLoopState`, `SFTState`) with a `to_json`; the RNG copies and loop states of all
ranks are equal, so rank 0's stands for all.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from temper.checkpoint.atomic import clear_interrupted
from temper.checkpoint.run_state import LoopState, RunState, load_run_state, save_run_state
from temper.checkpoint.storage import CheckpointStorage
from temper.client.training_client import TrainingClient
from temper.distributed.ranks import Ranks
from temper.observability import MetricsLogger, plot_metrics

CHECKPOINTS_DIR = "checkpoints"
"""A run directory's checkpoint storage (`tinker://` paths of the run's service client)."""


def other_world_note(saved: RunState, *, run_dir: Path) -> str:
    """A sentence to add to a resume message when this job has another number of processes
    than the run had ('' when the same)."""
    now = Ranks.world_size_now()
    if saved.world_size == now:
        return ""
    return (
        f" It ran on {saved.world_size} processes and continues on {now}, which does not "
        f"reproduce it bitwise; `temper train --resume {run_dir} --nproc {saved.world_size}` "
        "resumes it as it ran."
    )


def state_to_resume(run_dir: Path, *, total_steps: int, storage: CheckpointStorage) -> RunState:
    """The run state `--resume` continues from; a run that did all `total_steps` steps is an
    error (before anything is built or written: a finished run stays as it is).

    First what a kill during a save left in the run directory and its checkpoint `storage`
    is cleared up (a staging directory goes; a run state moved aside comes back)."""
    clear_interrupted(run_dir)
    storage.clear_interrupted()
    saved = load_run_state(run_dir)
    if saved.step >= total_steps:
        raise ValueError(
            f"--resume {run_dir}: the run already finished all {total_steps} steps; nothing to "
            "resume (its outputs are in place: see its plots/ and checkpoints/)"
        )
    return saved


class RunCheckpoints:
    """Full-state checkpoints every `every` steps (0: only at the end) and after step
    `total_steps`, keeping the last; then the final weights and the report."""

    def __init__(
        self,
        *,
        run_dir: Path,
        training: TrainingClient,
        every: int,
        total_steps: int,
        previous: RunState | None,
        ranks: Ranks,
    ) -> None:
        self.run_dir = run_dir
        self.training = training
        self.every = every
        self.total_steps = total_steps
        self.ranks = ranks
        self.previous = None if previous is None else previous.train_state
        """The train state of the checkpoint the run state names now (deleted once replaced)."""

    def due(self, steps_done: int) -> bool:
        return steps_done == self.total_steps or (self.every > 0 and steps_done % self.every == 0)

    def step_done(self, steps_done: int, state: LoopState) -> None:
        """After `steps_done` steps: save a checkpoint with the job's `state` if one is due."""
        if not self.due(steps_done):
            return
        path = self.training.save_state(f"step-{steps_done:06d}").result().path
        run_state = RunState(
            step=steps_done,
            train_state=path,
            loop=state.to_json(),
            world_size=Ranks.world_size_now(),
        )
        self.ranks.on_writer(functools.partial(self._record, run_state))
        self.previous = path

    def _record(self, run_state: RunState) -> None:
        """Rank 0: the run state names the new checkpoint only once it is complete (all ranks
        wrote their shards); then the previous one goes."""
        save_run_state(self.run_dir, run_state)
        if self.previous is not None and self.previous != run_state.train_state:
            self.training.service.storage.delete(self.previous)

    def save_final(self) -> str:
        """Save the final weights for sampling; their `tinker://<run>/sampler_weights/final`."""
        return self.training.save_weights_for_sampler("final").result().path

    def report(
        self,
        logger: MetricsLogger,
        *,
        sampler_path: str,
        summary: Mapping[str, Mapping[str, Any]],
        title: str,
        sample_flags: str = "",
    ) -> None:
        """Plot metrics.jsonl (rank 0), show the summary table and where the outputs are
        (`sample_flags`: what `temper sample` needs besides the model, e.g. the chat format)."""
        plots = self.ranks.on_writer(functools.partial(plot_metrics, self.run_dir))
        logger.summary(summary, title=title)
        # plot_metrics returns the figures, then the index.html that shows them all.
        _, weights_dir = self.training.service.storage.existing(sampler_path)
        # Paths are printed whole (no wrapping at the console's width), so they can be copied.
        logger.console.print(
            f"plots: {plots[-1]}\nsampler weights: {weights_dir} ({sampler_path})\n"
            f"sample them: temper sample --model {self.run_dir} {sample_flags}--prompt ...",
            soft_wrap=True,
        )
