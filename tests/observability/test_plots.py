"""plot_metrics writes readable PNGs from metrics.jsonl; metric_series handles resumes."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from temper.observability import MetricsLogger, metric_series, plot_metrics

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def write_run(run_dir: Path, *, num_steps: int = 40) -> None:
    config = MetricsLogger.Config(display="none")
    with config.build(run_dir=run_dir, total_steps=num_steps, description="rl") as logger:
        for step in range(num_steps):
            metrics = {
                "train/loss": math.exp(-step / 10),
                "train/lr": 1e-3,
                "env/reward/mean": step / num_steps,
                "time/sample": 0.01,
                "tokens": 100 * step,
            }
            if step % 10 == 0:
                metrics["eval/accuracy"] = step / num_steps
                metrics["eval/loss"] = 1.0
            logger.log(step, metrics)


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 1000, path


def test_plots_per_group_and_overlays(tmp_path: Path) -> None:
    write_run(tmp_path)
    paths = plot_metrics(tmp_path)
    names = [path.name for path in paths]
    assert names == [
        "env.png",
        "eval.png",
        "metrics.png",  # names without a '/' group
        "time.png",
        "train.png",
        "reward.png",
        "accuracy.png",
        "loss.png",
    ]
    assert all(path.parent == tmp_path / "plots" for path in paths)
    for path in paths:
        assert_png(path)


def test_keys_and_out_dir_restrict_the_output(tmp_path: Path) -> None:
    write_run(tmp_path)
    out_dir = tmp_path / "figures"
    paths = plot_metrics(tmp_path / "metrics.jsonl", out_dir=out_dir, keys=["train/loss"])
    assert [path.name for path in paths] == ["train.png", "loss.png"]
    assert sorted(path.name for path in out_dir.iterdir()) == ["loss.png", "train.png"]
    with pytest.raises(ValueError, match=r"\['eval/acc'\].*eval/accuracy"):
        plot_metrics(tmp_path, keys=["eval/acc"])


def test_group_named_like_an_overlay_does_not_collide(tmp_path: Path) -> None:
    lines = [{"step": step, "time": 0.0, "reward/mean": step * 0.1} for step in range(3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    paths = plot_metrics(tmp_path)
    assert [path.name for path in paths] == ["reward_group.png", "reward.png"]
    for path in paths:
        assert_png(path)


def test_missing_or_empty_metrics_name_the_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "metrics.jsonl"))):
        plot_metrics(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"metrics\.jsonl has no metric values"):
        plot_metrics(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "time": 1.0, "loss": null}\n')
    with pytest.raises(ValueError, match="no metric values"):
        plot_metrics(tmp_path)


def test_series_skip_nulls_and_let_a_resume_replace_later_steps() -> None:
    records = [
        {"step": 0, "time": 0.0, "loss": 3.0, "acc": 0.1},
        {"step": 1, "time": 0.0, "loss": None},
        {"step": 2, "time": 0.0, "loss": 2.0},
        {"step": 3, "time": 0.0, "loss": 1.5, "acc": 0.3},
        # Resumed from the step-2 checkpoint: steps 2 and 3 are redone.
        {"step": 2, "time": 0.0, "loss": 2.1},
        {"step": 3, "time": 0.0, "loss": 1.6},
    ]
    series = metric_series(records)
    assert series["loss"].steps == [0, 2, 3]
    assert series["loss"].values == [3.0, 2.1, 1.6]
    assert series["acc"].steps == [0]  # the step-3 value belonged to the abandoned timeline
