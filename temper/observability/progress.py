"""The console progress bar of `MetricsLogger`: one line per phase of a run, readable at 80
columns.

A run may have several phases on one step axis (an SFT warm-up, then RL). Each phase gets its
own bar, counted in its own steps ("SFT warm-up step 640/1000", then "GRPO step 12/100"), which
appears when the phase logs its first step (no bar for a phase that has not started). After its
last step (or when the next phase begins) the bar is replaced by one printed line with its final
metrics, so the live line only ever shows the current phase's metrics.

The line is laid out so that a narrow terminal crops the metrics (with an ellipsis), never the
step count or the ETA: the description, step count, a short bar and the ETA have fixed widths
and the metrics column takes what is left. There is no elapsed-time column on the live line
(the finished-phase line reports it).

Off a terminal (a log file, a pipe, CI, a cluster job's output) a live bar cannot be redrawn,
so `PhaseLines` prints the same progress as plain lines instead: the phase's first step, then
one line per tenth of the phase or per minute, whichever comes first, each with its elapsed
time and ETA, and the finished-phase line.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeRemainingColumn,
)
from rich.table import Column
from rich.text import Text

BAR_WIDTH = 10


@dataclasses.dataclass(frozen=True)
class Phase:
    """Steps `first_step` .. `first_step + num_steps - 1` of a run, under one name."""

    description: str
    first_step: int = 0
    num_steps: int | None = None
    """None: unknown (the bar shows no total and no ETA)."""


class PhaseProgress:
    """A rich progress display with one live bar, for the phase running now."""

    def __init__(self, *, console: Console) -> None:
        self.console = console
        self._progress = Progress(
            TextColumn("{task.description}", markup=False),
            _StepColumn(),
            BarColumn(bar_width=BAR_WIDTH),
            TextColumn("eta"),
            TimeRemainingColumn(),
            _MetricsColumn(table_column=Column(ratio=1, no_wrap=False)),
            console=console,
        )
        self._task: int | None = None
        self._phase: Phase | None = None
        self._phase_started = time.monotonic()
        self._progress.start()

    def begin(self, phase: Phase) -> None:
        """From now on count `phase`; the previous phase's bar becomes a printed line."""
        self._end_current()
        self._phase = phase
        self._phase_started = time.monotonic()

    def update(self, step: int, shown: Sequence[tuple[str, str]]) -> None:
        """`step` (of the run) is done; `shown` are the (name, formatted value) pairs to show."""
        assert self._phase is not None, "begin() a phase before update()"
        done = step - self._phase.first_step + 1
        metrics = "  ".join(f"{name} {value}" for name, value in shown)
        if self._task is None:
            # Created at the phase's first logged step, with the steps done: a resumed phase's
            # earlier steps do not count as this session's speed in the ETA.
            self._task = self._progress.add_task(
                self._phase.description,
                total=self._phase.num_steps,
                completed=done,
                metrics=metrics,
            )
        else:
            self._progress.update(self._task, completed=done, metrics=metrics)
        if self._phase.num_steps is not None and done >= self._phase.num_steps:
            self._end_current()  # before whatever the job prints next

    def stop(self) -> None:
        """Stop the live display; its last frame stays on the console."""
        self._progress.stop()

    def _end_current(self) -> None:
        if self._task is None:
            return
        task = self._progress.tasks[self._progress.task_ids.index(self._task)]
        self._progress.remove_task(self._task)
        self._progress.refresh()  # else the print below repeats the last frame drawn
        self._task = None
        assert self._phase is not None  # the task is the phase's
        seconds = time.monotonic() - self._phase_started
        done, metrics = int(task.completed), task.fields["metrics"]
        self.console.print(_finished(self._phase, done=done, seconds=seconds, metrics=metrics))


class PhaseLines:
    """The progress of `PhaseProgress` as plain printed lines, for a console that is not a
    terminal (same methods)."""

    EVERY_S = 60.0
    """The most seconds between two lines of a phase."""

    def __init__(self, *, console: Console) -> None:
        self.console = console
        self._phase: Phase | None = None
        self._started = self._last_line = time.monotonic()
        self._first_done = 0  # steps done before this session's first update (a resumed phase)
        self._done: int | None = None  # steps done at the last update; None: none yet
        self._metrics = ""

    def begin(self, phase: Phase) -> None:
        """From now on count `phase`; the previous one, if it logged, ends with its line."""
        self._end_current()
        self._phase = phase
        self._started = self._last_line = time.monotonic()
        self._done = None

    def update(self, step: int, shown: Sequence[tuple[str, str]]) -> None:
        """`step` (of the run) is done; `shown` are the (name, formatted value) pairs."""
        phase = self._phase
        assert phase is not None, "begin() a phase before update()"
        done = step - phase.first_step + 1
        self._metrics = "  ".join(f"{name} {value}" for name, value in shown)
        previous, self._done = self._done, done
        if phase.num_steps is not None and done >= phase.num_steps:
            self._end_current()
            return
        now = time.monotonic()
        if previous is None:
            self._first_done = done - 1
        elif now - self._last_line < self.EVERY_S and not (
            phase.num_steps and done * 10 // phase.num_steps > previous * 10 // phase.num_steps
        ):
            return  # neither a new tenth of the phase nor a minute since the last line
        self._last_line = now
        # One line per update whatever its length: a log or a pipe has no width to wrap to.
        self.console.print(Text(self._line(done, seconds=now - self._started)), soft_wrap=True)

    def stop(self) -> None:
        """Nothing is live: the last line printed stays."""

    def _line(self, done: int, *, seconds: float) -> str:
        phase = self._phase
        assert phase is not None
        total = f"/{phase.num_steps}" if phase.num_steps is not None else ""
        timing = f"{_clock(seconds)} elapsed"
        steps_here = done - self._first_done
        if phase.num_steps is not None and steps_here > 0:
            timing += f", eta {_clock(seconds / steps_here * (phase.num_steps - done))}"
        line = f"{phase.description} step {done}{total}  ({timing})"
        return f"{line}  {self._metrics}" if self._metrics else line

    def _end_current(self) -> None:
        phase, done = self._phase, self._done
        if phase is None or done is None:
            return
        self._done = None
        seconds = time.monotonic() - self._started
        self.console.print(
            _finished(phase, done=done, seconds=seconds, metrics=self._metrics), soft_wrap=True
        )


def _finished(phase: Phase, *, done: int, seconds: float, metrics: str) -> Text:
    """The line a phase's progress ends with: its steps, its time and its last metrics."""
    total = f"/{phase.num_steps}" if phase.num_steps is not None else ""
    line = f"{phase.description} done: {done}{total} steps in {_clock(seconds)}"
    return Text(f"{line}  {metrics}" if metrics else line)


def _clock(seconds: float) -> str:
    """h:mm:ss."""
    whole = int(seconds)
    return f"{whole // 3600}:{whole // 60 % 60:02d}:{whole % 60:02d}"


class _StepColumn(ProgressColumn):
    """`step i/N` of the task's phase."""

    def render(self, task: Task) -> Text:
        total = f"/{int(task.total)}" if task.total is not None else ""
        return Text(f"step {int(task.completed)}{total}")


class _MetricsColumn(ProgressColumn):
    """The metrics, cropped with an ellipsis to the width the other columns leave."""

    def render(self, task: Task) -> Text:
        return Text(task.fields["metrics"], no_wrap=True, overflow="ellipsis")
