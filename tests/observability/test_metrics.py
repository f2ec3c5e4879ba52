"""MetricsLogger sinks (console, metrics.jsonl, TensorBoard) and read_metrics."""

from __future__ import annotations

import importlib.util
import inspect
import io
import json
import math
import re
import sys
import time
import warnings
from pathlib import Path

import pytest
from rich.console import Console

import temper.observability as observability
from temper.observability import MetricsLogger, format_value, read_metrics


def quiet_config(**overrides) -> MetricsLogger.Config:
    return MetricsLogger.Config(display="none", **overrides)


def captured_console() -> tuple[Console, io.StringIO]:
    # A file-backed console is not a terminal, like stdout in CI or a pipe.
    buffer = io.StringIO()
    return Console(file=buffer, width=120, color_system=None), buffer


def test_jsonl_is_appended_across_loggers(tmp_path: Path) -> None:
    with quiet_config().build(run_dir=tmp_path, total_steps=3, description="sft") as logger:
        logger.log(0, {"train/loss": 2.5, "train/tokens": 128})
        logger.log(1, {"train/loss": 2.0})
    # A resumed run builds a new logger on the same run dir.
    with quiet_config().build(run_dir=tmp_path, total_steps=3, description="sft") as logger:
        logger.log(2, {"train/loss": 1.5, "eval/accuracy": 0.25})

    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [record["step"] for record in records] == [0, 1, 2]
    assert records[0]["train/tokens"] == 128.0
    assert [record["train/loss"] for record in records] == [2.5, 2.0, 1.5]
    assert records[2]["eval/accuracy"] == 0.25
    assert all(isinstance(record["time"], float) for record in records)
    assert records[0]["time"] <= records[2]["time"]


def test_lines_are_flushed_before_close(tmp_path: Path) -> None:
    logger = quiet_config().build(run_dir=tmp_path, total_steps=None, description="rl")
    logger.log(0, {"env/reward/mean": 0.5})
    assert read_metrics(tmp_path / "metrics.jsonl")[0]["env/reward/mean"] == 0.5
    logger.close()
    logger.close()  # idempotent


def test_tensor_and_integer_values_become_floats(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    with quiet_config().build(run_dir=tmp_path, total_steps=1, description="sft") as logger:
        logger.log(0, {"train/loss": torch.tensor(0.75), "train/count": 3, "flag": True})
        assert logger.latest == {"train/loss": 0.75, "train/count": 3.0, "flag": 1.0}
    (record,) = read_metrics(tmp_path / "metrics.jsonl")
    assert record["train/loss"] == 0.75 and record["train/count"] == 3.0


def test_non_finite_values_are_null_and_warned_once_per_name(tmp_path: Path) -> None:
    with (
        quiet_config().build(run_dir=tmp_path, total_steps=3, description="sft") as logger,
        pytest.warns(RuntimeWarning) as caught,
    ):
        logger.log(0, {"train/loss": math.nan, "train/grad_norm": math.inf})
        logger.log(1, {"train/loss": math.nan, "train/grad_norm": 1.0})
        logger.log(2, {"train/loss": math.nan})
    messages = [str(warning.message) for warning in caught]
    assert len(messages) == 2
    assert any("'train/loss'" in message for message in messages)
    assert any("'train/grad_norm'" in message for message in messages)

    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    first = json.loads(lines[0])  # strict JSON: no NaN/Infinity tokens
    assert first["train/loss"] is None and first["train/grad_norm"] is None
    assert json.loads(lines[1])["train/grad_norm"] == 1.0
    assert math.isnan(logger.latest["train/loss"])


def test_read_metrics_reports_the_malformed_line(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "time": 1.0, "a": 1.0}\n\n{"step": 1, "time": 2.0, "a": \n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl:3: malformed JSON"):
        read_metrics(path)
    path.write_text('{"step": 0}\n["not", "an", "object"]\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2: expected a JSON object"):
        read_metrics(path)
    with pytest.raises(FileNotFoundError):
        read_metrics(tmp_path / "missing.jsonl")


def test_table_is_printed_every_n_steps(tmp_path: Path) -> None:
    console, buffer = captured_console()
    config = MetricsLogger.Config(display="table", table_every=3, jsonl=False)
    with config.build(run_dir=tmp_path, total_steps=10, description="sft", console=console) as lg:
        for step in range(10):
            metrics = {"train/loss": 1.0 / (step + 1), "train/lr": 3e-4}
            if step == 4:
                metrics["eval/accuracy"] = 0.123456
            lg.log(step, metrics)
    output = buffer.getvalue()
    titles = [line.strip() for line in output.splitlines() if line.strip().startswith("sft step")]
    assert titles == ["sft step 1/10", "sft step 3/10", "sft step 6/10", "sft step 9/10"]
    assert "loss 0.1111   lr 0.0003" in output  # four significant digits
    assert "accuracy 0.1235 @4" in output  # a value from an earlier step is marked with it
    assert not (tmp_path / "metrics.jsonl").exists()


def test_per_layer_metrics_go_to_the_jsonl_but_not_the_console_table(tmp_path: Path) -> None:
    console, buffer = captured_console()
    config = MetricsLogger.Config(display="table", table_every=1)
    metrics = {"moe/aux_loss": 2.25, "moe/max_load": 1.75}
    metrics |= {f"moe/layer_{i:02d}/entropy": 2.0 for i in range(48)}
    with config.build(run_dir=tmp_path, total_steps=1, description="rl", console=console) as lg:
        lg.log(0, metrics)
    output = buffer.getvalue()
    assert "aux_loss 2.25   max_load 1.75" in output
    assert "layer_" not in output
    (record,) = read_metrics(tmp_path / "metrics.jsonl")
    assert record["moe/layer_47/entropy"] == 2.0


def test_a_phase_is_counted_in_its_own_steps_in_the_tables(tmp_path: Path) -> None:
    console, buffer = captured_console()
    config = MetricsLogger.Config(display="table", table_every=2, jsonl=False)
    with config.build(run_dir=tmp_path, total_steps=6, description="GRPO", console=console) as lg:
        lg.begin_phase("SFT warm-up", first_step=0, num_steps=2)
        lg.log(0, {"loss": 1.0})
        lg.begin_phase("GRPO", first_step=2, num_steps=4)
        lg.log(2, {"loss": 0.5})
    words = " ".join(buffer.getvalue().split())  # a title may wrap to the table's width
    assert "SFT warm-up step 1/2" in words and "GRPO step 1/4 (run step 2)" in words
    assert "/6" not in words


def terminal_80() -> Console:
    return Console(file=io.StringIO(), width=80, force_terminal=True, color_system=None)


def screen_lines(console: Console) -> list[str]:
    """Every frame the console drew, one per line (a live bar redraws its line after '\r')."""
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", console.file.getvalue())
    return [line for line in re.split(r"[\r\n]", text) if line.strip()]


def final_line(console: Console, description: str) -> str:
    """The last frame of the bar named `description` (what stays on screen at close)."""
    return [line for line in screen_lines(console) if line.startswith(description)][-1]


def rl_run_with_warmup(console: Console, tmp_path: Path, *, rl_steps_done: int) -> None:
    """Log like the RL job: a 10-step warm-up, evaluated at its end, then RL steps."""
    config = MetricsLogger.Config(
        table_every=0,
        jsonl=False,
        progress_keys=("reward/mean", "eval/accuracy", "warmup/loss"),
    )
    with config.build(run_dir=tmp_path, total_steps=110, description="GRPO", console=console) as lg:
        lg.begin_phase("SFT warm-up", first_step=0, num_steps=10)
        for step in range(10):
            metrics = {"warmup/loss": 0.123456789, "optim/grad_norm": 3.14159, "optim/lr": 1e-3}
            if step == 9:
                metrics["eval/accuracy"] = 0.876543
            lg.log(step, metrics)
        lg.begin_phase("GRPO", first_step=10, num_steps=100)
        for step in range(10, 10 + rl_steps_done):
            lg.log(step, {"reward/mean": 0.5123456, "reward/std": 0.25, "optim/lr": 3e-5})
            time.sleep(0.01)  # so the bar has a speed, hence an ETA


def test_rl_progress_at_80_columns_keeps_step_eta_and_current_metrics(tmp_path: Path) -> None:
    console = terminal_80()
    rl_run_with_warmup(console, tmp_path, rl_steps_done=5)
    line = final_line(console, "GRPO")
    assert len(line) <= 80
    assert "step 5/100" in line
    assert re.search(r"eta \d+:\d\d:\d\d", line), line
    assert "reward/mean 0.5123" in line
    assert "warmup/loss" not in line and "eval/accuracy" not in line  # the warm-up's, stale
    # The warm-up's bar became a line with its final metrics, counted to its own length.
    text = "\n".join(screen_lines(console))
    assert "SFT warm-up done: 10/10 steps" in text
    assert "warmup/loss 0.1235" in text and "eval/accuracy 0.8765" in text
    assert "/110" not in text


def test_warmup_progress_counts_its_own_steps_and_no_bar_precedes_it(tmp_path: Path) -> None:
    console = terminal_80()
    config = MetricsLogger.Config(table_every=0, jsonl=False, progress_keys=("warmup/loss",))
    # The RL job's logger is named for the whole run (110 steps) before its warm-up begins.
    with config.build(run_dir=tmp_path, total_steps=110, description="GRPO", console=console) as lg:
        lg.begin_phase("SFT warm-up", first_step=0, num_steps=10)
        for step in range(10):
            lg.log(step, {"warmup/loss": 0.123456789})
    *bars, done = screen_lines(console)
    assert bars and all(line.startswith("SFT warm-up step") for line in bars)
    assert all("/10 " in line and len(line) <= 80 for line in bars)
    assert done.startswith("SFT warm-up done: 10/10 steps") and "warmup/loss 0.1235" in done


def test_long_metrics_are_cropped_before_the_step_count_and_eta(tmp_path: Path) -> None:
    console = terminal_80()
    keys = tuple(f"group/a_rather_long_metric_name_{i}" for i in range(4))
    config = MetricsLogger.Config(table_every=0, jsonl=False, progress_keys=keys)
    with config.build(
        run_dir=tmp_path, total_steps=1000, description="SFT warm-up", console=console
    ) as lg:
        for step in range(3):
            lg.log(step, dict.fromkeys(keys, 0.123456))
            time.sleep(0.01)
    line = final_line(console, "SFT warm-up step")
    assert "step 3/1000" in line and "eta " in line and "group/a_rather" in line
    assert len(line) <= 80


def test_a_table_per_interval_when_logging_sparsely(tmp_path: Path) -> None:
    console, buffer = captured_console()
    config = MetricsLogger.Config(display="table", table_every=10, jsonl=False)
    with config.build(run_dir=tmp_path, total_steps=None, description="rl", console=console) as lg:
        for step in range(3, 40, 4):  # a resumed run that logs every 4th step
            lg.log(step, {"loss": 1.0})
    titles = [line.strip() for line in buffer.getvalue().splitlines() if "rl step" in line]
    assert titles == ["rl step 4", "rl step 12", "rl step 20", "rl step 32", "rl step 40"]


def test_off_a_terminal_progress_is_a_line_per_tenth_of_each_phase(tmp_path: Path) -> None:
    console, buffer = captured_console()
    assert not console.is_terminal
    config = MetricsLogger.Config(table_every=0, progress_keys=("train/loss",), jsonl=False)
    with config.build(run_dir=tmp_path, total_steps=60, description="sft", console=console) as lg:
        lg.begin_phase("warm-up", first_step=0, num_steps=10)
        for step in range(10):
            lg.log(step, {"train/loss": 0.5, "train/lr": 1e-3})
        lg.begin_phase("GRPO", first_step=10, num_steps=50)
        for step in range(10, 35):  # stopped halfway: no "done" line
            lg.log(step, {"train/loss": 0.25})
    lines = buffer.getvalue().splitlines()
    assert "\r" not in buffer.getvalue() and "\x1b" not in buffer.getvalue()  # no live bar
    warmup = [line for line in lines if line.startswith("warm-up")]
    assert [line.split("  ")[0] for line in warmup[:-1]] == [
        f"warm-up step {done}/10" for done in range(1, 10)
    ]
    assert warmup[-1].startswith("warm-up done: 10/10 steps in 0:00:0")
    grpo = [line.split("  ")[0] for line in lines if line.startswith("GRPO")]
    assert grpo == [f"GRPO step {done}/50" for done in (1, 5, 10, 15, 20, 25)]
    last = [line for line in lines if line.startswith("GRPO")][-1]
    assert re.search(r"\(0:00:\d\d elapsed, eta 0:00:\d\d\)  train/loss 0\.25$", last), last
    assert "train/lr" not in buffer.getvalue()


def test_off_a_terminal_slow_steps_print_a_line_a_minute(tmp_path: Path, monkeypatch) -> None:
    console, buffer = captured_console()
    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    config = MetricsLogger.Config(table_every=0, jsonl=False)
    with config.build(run_dir=tmp_path, total_steps=1000, description="rl", console=console) as lg:
        for step in range(4):
            clock[0] += 45.0  # 45 s a step: lines at steps 1, 3 (90 s after 1), not 2 or 4
            lg.log(step, {"loss": 1.0})
    steps = [line.split("  ")[0] for line in buffer.getvalue().splitlines()]
    assert steps == ["rl step 1/1000", "rl step 3/1000"]


def test_progress_bar_on_a_terminal_shows_chosen_keys(tmp_path: Path) -> None:
    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=True, width=200, color_system=None)
    config = MetricsLogger.Config(table_every=0, progress_keys=("train/loss",), jsonl=False)
    with config.build(run_dir=tmp_path, total_steps=50, description="sft", console=console) as lg:
        for step in range(50):
            lg.log(step, {"train/loss": 0.5, "train/lr": 1e-3})
    final = [line for line in buffer.getvalue().splitlines() if "50/50" in line][-1]
    assert "50/50" in final and "train/loss 0.5" in final and "train/lr" not in final


def test_summary_prints_caller_values(tmp_path: Path) -> None:
    console, buffer = captured_console()
    config = MetricsLogger.Config(display="table", table_every=0, jsonl=False)
    with config.build(run_dir=tmp_path, total_steps=2, description="sft", console=console) as lg:
        lg.log(0, {"eval/accuracy": 0.5, "train/loss": 2.0})
        lg.log(1, {"eval/accuracy": 0.25, "train/loss": 1.0})
        lg.summary({"final": lg.latest, "best": {"eval/accuracy": 0.5}}, title="SFT warm-up")
    output = buffer.getvalue()
    assert "SFT warm-up" in output
    accuracy_row = next(line for line in output.splitlines() if "eval/accuracy" in line)
    assert "0.25" in accuracy_row and "0.5" in accuracy_row
    loss_row = next(line for line in output.splitlines() if "train/loss" in line)
    assert "-" in loss_row.replace("train/loss", "")  # no best value given


def test_display_none_prints_nothing(tmp_path: Path) -> None:
    console, buffer = captured_console()
    with quiet_config().build(
        run_dir=tmp_path, total_steps=5, description="x", console=console
    ) as lg:
        for step in range(5):
            lg.log(step, {"a": 1.0})
        lg.summary({"final": lg.latest})
    assert buffer.getvalue() == ""


def test_tensorboard_without_package_names_the_extra(tmp_path: Path, monkeypatch) -> None:
    # Simulate the extra being absent even where it happens to be installed.
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    config = MetricsLogger.Config(display="none", tensorboard=True)
    with pytest.raises(ImportError, match=r"pip install -e '\.\[tensorboard\]'"):
        config.build(run_dir=tmp_path, total_steps=1, description="sft")
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.skipif(
    importlib.util.find_spec("tensorboard") is None, reason="tensorboard extra not installed"
)
def test_tensorboard_writes_event_files(tmp_path: Path) -> None:
    config = MetricsLogger.Config(display="none", tensorboard=True)
    with config.build(run_dir=tmp_path, total_steps=1, description="sft") as logger:
        logger.log(0, {"train/loss": 1.0})
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


@pytest.mark.parametrize(
    ("overrides", "field"),
    [({"display": "fancy"}, "display"), ({"table_every": -1}, "table_every")],
)
def test_bad_config_names_the_field(overrides: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        MetricsLogger.Config(**overrides)


def test_bad_log_calls_are_rejected(tmp_path: Path) -> None:
    with quiet_config().build(run_dir=tmp_path, total_steps=None, description="sft") as logger:
        with pytest.raises(TypeError, match=r"'train/loss'.*str"):
            logger.log(0, {"train/loss": "0.5"})
        with pytest.raises(ValueError, match="'step'"):
            logger.log(0, {"step": 1.0})
        with pytest.raises(ValueError, match="step=-1"):
            logger.log(-1, {"a": 1.0})
        logger.log(5, {"a": 1.0})
        logger.log(5, {"b": 1.0})  # several calls per step are fine
        with pytest.raises(ValueError, match="step=4 is before"):
            logger.log(4, {"a": 1.0})
    with pytest.raises(RuntimeError, match="after close"):
        logger.log(6, {"a": 1.0})
    with pytest.raises(ValueError, match="total_steps"):
        quiet_config().build(run_dir=tmp_path, total_steps=-3, description="sft")


def test_unused_progress_key_is_warned_at_close(tmp_path: Path) -> None:
    config = quiet_config(progress_keys=("train/loss", "eval/acc"), jsonl=False)
    logger = config.build(run_dir=tmp_path, total_steps=1, description="sft")
    logger.log(0, {"train/loss": 1.0})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logger.close()
    assert len(caught) == 1 and "'eval/acc'" in str(caught[0].message)


def test_a_resumed_run_is_not_warned_about_keys_it_logged_before_it_stopped(
    tmp_path: Path,
) -> None:
    config = quiet_config(progress_keys=("warmup/loss", "reward/mean"))
    logger = config.build(run_dir=tmp_path, total_steps=4, description="rl")
    with pytest.raises(KeyboardInterrupt), logger:  # stopped after the warm-up
        logger.log(0, {"warmup/loss": 1.0})
        raise KeyboardInterrupt
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # Resumed after the warm-up: only RL steps are logged now.
        with config.build(run_dir=tmp_path, total_steps=4, description="rl") as logger:
            logger.log(1, {"reward/mean": 0.5})
    assert caught == []


def test_a_run_stopped_early_is_not_warned_about_keys_it_had_no_time_to_log(
    tmp_path: Path,
) -> None:
    config = quiet_config(progress_keys=("train/loss", "eval/acc"), jsonl=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logger = config.build(run_dir=tmp_path, total_steps=5, description="sft")
        with pytest.raises(KeyboardInterrupt), logger:
            logger.log(0, {"train/loss": 1.0})
            raise KeyboardInterrupt
    assert caught == []


def test_format_value() -> None:
    assert format_value(0.000123456) == "0.0001235"
    assert format_value(123456.7) == "1.235e+05"
    assert format_value(4096.0) == "4096"
    assert format_value(math.nan) == "nan"


def test_public_api() -> None:
    for name in observability.__all__:
        assert hasattr(observability, name)
    parameters = inspect.signature(MetricsLogger.__init__).parameters
    assert [p for p in parameters if parameters[p].kind is inspect.Parameter.KEYWORD_ONLY] == [
        "run_dir",
        "total_steps",
        "description",
        "console",
    ]
    fields = MetricsLogger.Config.__dataclass_fields__
    assert {"display", "table_every", "progress_keys", "jsonl", "tensorboard"} <= set(fields)


def test_off_a_terminal_a_long_progress_line_is_not_wrapped(tmp_path: Path) -> None:
    # A log file or a pipe: the console's width (80 by default there) must not cut a line.
    buffer = io.StringIO()
    console = Console(file=buffer, width=80, color_system=None)
    keys = tuple(f"group/metric_{index}" for index in range(6))
    config = MetricsLogger.Config(table_every=0, progress_keys=keys, jsonl=False)
    with config.build(run_dir=tmp_path, total_steps=10, description="rl", console=console) as lg:
        for step in range(10):
            lg.log(step, dict.fromkeys(keys, 0.123456))
    lines = buffer.getvalue().splitlines()
    assert lines and all(line.startswith("rl ") for line in lines), lines
    assert max(len(line) for line in lines) > 80
