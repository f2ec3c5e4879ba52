"""Per-step scalar metrics: console (rich progress bar and tables), metrics.jsonl, TensorBoard.

One `MetricsLogger.log(step, {name: value})` call fans out to every enabled sink. Things that
are easy to get wrong and handled here:

- `metrics.jsonl` is opened in append mode and flushed after every line, so a resumed run
  continues the same file and a crash loses at most the line being written.
- JSON has no NaN or infinity: non-finite values are written as `null` and warned about once
  per metric name (the console still shows `nan`/`inf`).
- Steps count from 0; after `log(step, ...)` the progress bar shows `step + 1` of
  `total_steps` done.
- A run of several phases on one step axis (an SFT warm-up, then RL) names each with
  `begin_phase`: the console counts a phase in its own steps and shows only the metrics logged
  during it (progress.py), while metrics.jsonl keeps the run's step.
- Per-layer metrics (`moe/layer_07/max_load`) go to metrics.jsonl and TensorBoard but not to
  the console tables, which show the summaries over layers instead.
- On a console that is not a terminal (CI, pipes) rich draws the progress bar once, when the
  logger closes, so the periodic tables are the progress record there.

It does not decide which rank logs: in a distributed run build it on rank 0 only.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import numbers
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any, Literal, get_args

from rich import get_console
from rich.console import Console
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from temper.config.checks import check_choice, check_range
from temper.config.configurable import Configurable
from temper.observability.progress import Phase, PhaseLines, PhaseProgress

Display = Literal["progress", "table", "none"]
RESERVED_KEYS = ("step", "time")
PER_LAYER = "/layer_"
"""Names with this part are one layer's value (`moe/layer_07/entropy`); the console tables
leave them out."""
METRICS_FILE_NAME = "metrics.jsonl"
TENSORBOARD_DIR_NAME = "tensorboard"
TENSORBOARD_INSTALL = (
    "install the extra from the repository's directory: pip install -e '.[tensorboard]'"
)


class MetricsLogger(Configurable):
    """Logs scalar metrics per step to the console, `run_dir/metrics.jsonl` and TensorBoard."""

    @dataclasses.dataclass(kw_only=True)
    class Config(Configurable.Config):
        display: Display = "progress"
        """Console output: 'progress' (a progress bar plus a table every `table_every` steps;
        off a terminal, a progress line per tenth of a phase or per minute), 'table' (tables
        only) or 'none' (no progress bar, tables or `summary()`; a job's own
        few lines, such as the paths it wrote, still print)."""

        table_every: int = 10
        """Steps between console tables of the latest metric values; 0 turns tables off."""

        progress_keys: tuple[str, ...] = ()
        """Metric names shown on the progress bar, those logged during the current phase;
        empty shows the first three names the phase logged."""

        jsonl: bool = True
        """Append one JSON object per `log()` call to `run_dir/metrics.jsonl`."""

        tensorboard: bool = False
        """Also write TensorBoard event files to `run_dir/tensorboard` (needs the extra: from
        the repository's directory, `pip install -e '.[tensorboard]'`)."""

        def missing_packages(self) -> dict[str, str]:
            if self.tensorboard and importlib.util.find_spec("tensorboard") is None:
                return {"tensorboard": f"the tensorboard package ({TENSORBOARD_INSTALL})"}
            return {}

        def __post_init__(self) -> None:
            owner = "MetricsLogger.Config"
            check_choice(self.display, field=f"{owner}.display", choices=get_args(Display))
            check_range(
                self.table_every,
                field=f"{owner}.table_every",
                integer=True,
                at_least=0,
                hint="0 turns tables off",
            )

    def __init__(
        self,
        config: Config,
        *,
        run_dir: Path,
        total_steps: int | None,
        description: str,
        console: Console | None = None,
    ) -> None:
        if total_steps is not None and (not isinstance(total_steps, int) or total_steps < 0):
            raise ValueError(f"total_steps={total_steps!r} must be None or an int >= 0")
        self.config = config
        self.run_dir = Path(run_dir)
        self.total_steps = total_steps
        self.console = console if console is not None else get_console()
        # TensorBoard first: a missing extra must fail before any file or live display opens.
        self._tensorboard_writer = _open_tensorboard(self.run_dir) if config.tensorboard else None
        self._jsonl_file: IO[str] | None = None
        # Names a resumed run logged before it stopped (a finished warm-up's loss): not warned
        # about at close as never logged.
        self._logged_before: set[str] = set()
        if config.jsonl:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._logged_before = _names_in(self.run_dir / METRICS_FILE_NAME)
            self._jsonl_file = (self.run_dir / METRICS_FILE_NAME).open("a", encoding="utf-8")
        self._latest: dict[str, tuple[int, float]] = {}  # name -> (step logged, value)
        self._warned_non_finite: set[str] = set()
        self._last_step: int | None = None
        self._last_table_step: int | None = None
        self._closed = False
        self._phase = Phase(description, first_step=0, num_steps=total_steps)
        self._progress: PhaseProgress | PhaseLines | None = None
        # Off a terminal (CI logs, pipes, a cluster job's output file) a live bar could only be
        # drawn once, at the end: the progress prints as plain lines there instead.
        if config.display == "progress":
            progress = PhaseProgress if self.console.is_terminal else PhaseLines
            self._progress = progress(console=self.console)
            self._progress.begin(self._phase)

    @property
    def description(self) -> str:
        """What the current phase's steps do (the progress bar's and the tables' title)."""
        return self._phase.description

    def begin_phase(self, description: str, *, first_step: int, num_steps: int) -> None:
        """Name the run's steps `first_step` .. `first_step + num_steps - 1`, which come next
        (a run of several phases on one step axis, e.g. an SFT warm-up, then RL).

        The console counts them as `<description> step i/num_steps` and shows only metrics
        logged from `first_step` on; the previous phase's bar becomes a printed line.
        """
        if isinstance(first_step, bool) or not isinstance(first_step, int) or first_step < 0:
            raise ValueError(f"first_step={first_step!r} must be an int >= 0")
        if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 0:
            raise ValueError(f"num_steps={num_steps!r} must be an int >= 0")
        self._phase = Phase(description, first_step=first_step, num_steps=num_steps)
        if self._progress is not None:
            self._progress.begin(self._phase)

    @property
    def latest(self) -> dict[str, float]:
        """The most recent value of every metric logged so far (e.g. for `summary()`)."""
        return {name: value for name, (_, value) in self._latest.items()}

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record `metrics` (floats, ints or 0-d tensors) for `step` in every enabled sink."""
        if self._closed:
            raise RuntimeError("MetricsLogger.log() called after close()")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step={step!r} must be an int >= 0")
        if self._last_step is not None and step < self._last_step:
            raise ValueError(
                f"step={step} is before the previously logged step {self._last_step}; "
                "steps must not decrease within one logger"
            )
        if not isinstance(metrics, Mapping):
            raise TypeError(f"metrics must be a mapping of name -> number, got {type(metrics)}")
        values = {_check_name(name): to_float(value, name=name) for name, value in metrics.items()}
        self._last_step = step
        self._write_sinks(step, values)
        self._latest.update({name: (step, value) for name, value in values.items()})
        if self._progress is not None:
            self._update_progress(step)
        if self._table_due(step):
            self._last_table_step = step
            self.console.print(self._latest_table(step))

    def summary(self, columns: Mapping[str, Mapping[str, Any]], *, title: str = "Summary") -> None:
        """Print a panel with one row per metric and one column per entry of `columns`.

        For example `summary({"final": logger.latest, "best": best_values})`.
        """
        if self.config.display != "none":
            self.console.print(summary_panel(columns, title=title))

    def close(self, *, warn_unlogged: bool = True) -> None:
        """Stop the progress bar and flush and close the files; safe to call twice.

        `warn_unlogged`: warn about `progress_keys` never logged (a misspelled name); off when
        a run stops early (an exception, Ctrl-C), before it could log them.
        """
        if self._closed:
            return
        self._closed = True
        if self._progress is not None:
            self._progress.stop()
        if self._jsonl_file is not None:
            self._jsonl_file.close()
        if self._tensorboard_writer is not None:
            self._tensorboard_writer.close()
        never_logged = [
            key
            for key in self.config.progress_keys
            if key not in self._latest and key not in self._logged_before
        ]
        if never_logged and warn_unlogged and self._last_step is not None:
            warnings.warn(
                f"MetricsLogger.Config.progress_keys {never_logged} were never logged "
                f"(logged names: {sorted(self._latest)})",
                stacklevel=2,
            )

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc_info: object) -> None:
        self.close(warn_unlogged=exc_type is None)

    def _write_sinks(self, step: int, values: dict[str, float]) -> None:
        now = time.time()
        for name, value in values.items():
            if not math.isfinite(value) and name not in self._warned_non_finite:
                self._warned_non_finite.add(name)
                warnings.warn(
                    f"metric {name!r} is {value} at step {step}; metrics.jsonl stores "
                    "non-finite values as null (warned once per metric)",
                    RuntimeWarning,
                    stacklevel=3,
                )
        if self._jsonl_file is not None:
            record = {"step": step, "time": now}
            record.update({n: v if math.isfinite(v) else None for n, v in values.items()})
            self._jsonl_file.write(json.dumps(record, allow_nan=False) + "\n")
            self._jsonl_file.flush()
        if self._tensorboard_writer is not None:
            for name, value in values.items():
                self._tensorboard_writer.add_scalar(name, value, global_step=step, walltime=now)

    def _update_progress(self, step: int) -> None:
        assert self._progress is not None
        # Only what the current phase logged: a finished phase's metrics are stale.
        fresh = [
            name for name, (logged, _) in self._latest.items() if logged >= self._phase.first_step
        ]
        keys = self.config.progress_keys or fresh[:3]
        shown = [(key, format_value(self._latest[key][1])) for key in keys if key in fresh]
        self._progress.update(step, shown)

    def _table_due(self, step: int) -> bool:
        every = self.config.table_every
        if self.config.display == "none" or every == 0:
            return False
        # Print when the steps done (step + 1) cross a multiple of `table_every`, so a phase of
        # 100 steps ends on a table and logging every k steps or resuming mid-interval still
        # gives one per interval.
        if self._last_table_step is None:
            return True
        return (step + 1) // every > (self._last_table_step + 1) // every

    def _latest_table(self, step: int) -> Table:
        phase = self._phase
        total = f"/{phase.num_steps}" if phase.num_steps is not None else ""
        # Counted in steps done, as the progress lines are; `step` (the metrics' index) is shown
        # beside it when a phase does not start at step 0.
        run_step = f" (run step {step})" if phase.first_step > 0 else ""
        done = step - phase.first_step + 1
        title = Text(f"{phase.description} step {done}{total}{run_step}")
        table = Table(title=title, title_justify="left")
        table.add_column("group", style="bold")
        table.add_column("metrics")
        groups: dict[str, list[Text]] = {}
        for name, (logged_step, value) in self._latest.items():
            if PER_LAYER in name:
                continue  # dozens a step for a deep model; metrics.jsonl and the plots have them
            group, _, short_name = name.partition("/") if "/" in name else ("", "", name)
            cell = Text.assemble((short_name, "cyan"), " ", format_value(value))
            if logged_step != step:
                cell.append(f" @{logged_step}", style="dim")
            groups.setdefault(group, []).append(cell)
        for group, cells in groups.items():
            table.add_row(group, Text("   ").join(cells))
        return table


def format_value(value: float) -> str:
    """Four significant digits; integral values (counts) are shown whole."""
    if math.isfinite(value) and value.is_integer() and abs(value) < 1e9:
        return str(int(value))
    return f"{value:.4g}"


def to_float(value: Any, *, name: str) -> float:
    """Convert a python number or a 0-d tensor/array to float; `name` is used in the error."""
    if isinstance(value, numbers.Real) or getattr(value, "ndim", None) == 0:
        return float(value)
    raise TypeError(
        f"metric {name!r} has value {value!r} of type {type(value).__name__}; expected a "
        "python number or a 0-d tensor"
    )


def summary_panel(columns: Mapping[str, Mapping[str, Any]], *, title: str) -> Panel:
    """A panel holding a table: rows are metric names, columns the keys of `columns`."""
    table = Table(show_edge=False)
    table.add_column("metric", style="cyan")
    for column in columns:
        table.add_column(column, justify="right")
    names = list(dict.fromkeys(name for values in columns.values() for name in values))
    for name in names:
        cells = [
            format_value(to_float(values[name], name=name)) if name in values else "-"
            for values in columns.values()
        ]
        table.add_row(name, *cells)
    return Panel(table, title=Text(title), expand=False)


def read_metrics(path: Path | str) -> list[dict[str, Any]]:
    """Read a metrics.jsonl file; a malformed line raises ValueError naming its line number."""
    path = Path(path)
    records = []
    with path.open(encoding="utf-8") as file:
        for line_number, line in enumerate(file, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(
                    f"{path}:{line_number}: malformed JSON ({err.msg}): {line[:80]!r}"
                ) from err
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                raise ValueError(
                    f"{path}:{line_number}: expected a JSON object with an int 'step', "
                    f"got {line[:80]!r}"
                )
            records.append(record)
    return records


def _names_in(path: Path) -> set[str]:
    """Metric names in an existing metrics.jsonl (none if there is no file); a line that does
    not parse (the one a crash cut short) is skipped."""
    if not path.is_file():
        return set()
    names: set[str] = set()
    with path.open(encoding="utf-8") as file:
        for line in file:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict):
                names.update(name for name in record if name not in RESERVED_KEYS)
    return names


def _check_name(name: Any) -> str:
    if not isinstance(name, str) or not name or name in RESERVED_KEYS:
        raise ValueError(
            f"metric name {name!r} is invalid: names are non-empty strings other than "
            f"{list(RESERVED_KEYS)}"
        )
    return name


def _open_tensorboard(run_dir: Path) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as err:
        raise ImportError(
            f"MetricsLogger.Config.tensorboard=True needs the tensorboard package "
            f"({TENSORBOARD_INSTALL}) or set tensorboard=False"
        ) from err
    return SummaryWriter(log_dir=str(run_dir / TENSORBOARD_DIR_NAME))
