"""plot_metrics writes one figure per question with labelled axes and an index of them;
metric_series handles resumes."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from temper.observability import draw_figure, figure_specs, metric_series, plot_metrics
from temper.observability.metrics import read_metrics

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
NUM_WARMUP, NUM_RL = 40, 40


def write_metrics(run_dir: Path, records: list[dict]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"time": 0.0, **record}) + "\n" for record in records]
    (run_dir / "metrics.jsonl").write_text("".join(lines))


def rl_records(*, mode: str = "sync") -> list[dict]:
    """What the RL job logs: an SFT warm-up (evaluated after its last step), then RL steps."""
    records = []
    for step in range(NUM_WARMUP):
        record = {
            "warmup/loss": 3.0 * math.exp(-step / 8),
            "optim/grad_norm": 5.0 + math.sin(step),
            "optim/lr": 2e-3 * (1 - step / NUM_WARMUP),
        }
        if step == NUM_WARMUP - 1:
            record["eval/accuracy"] = 0.5
        records.append({"step": step, **record})
    for rl_step in range(NUM_RL):
        record = {
            "reward/mean": 0.5 + 0.01 * rl_step,
            "reward/std": 0.2 + 0.01 * math.cos(rl_step),
            "rollout/stopped": 1.0,
            "rollout/response_length": 3.0 + 0.1 * math.sin(rl_step),
            "mismatch/kl": 1e-12 * (1 + rl_step),
            "mismatch/logprob_diff_max": 1e-6 * (1 + rl_step % 5),
            "async/staleness": float(rl_step % 2) if mode == "async" else 0.0,
            "optim/grad_norm": 20.0 + math.sin(rl_step),
            "optim/lr": 3e-5,
            "time/sample": 0.05 + 0.01 * math.sin(rl_step),
            "time/train": 0.06 + 0.01 * math.cos(rl_step),
            "time/total": 0.11 + 0.01 * math.sin(rl_step),
        }
        if rl_step % 10 == 9:
            record["eval/accuracy"] = 0.6 + 0.01 * rl_step
        records.append({"step": NUM_WARMUP + rl_step, **record})
    return records


def sft_records() -> list[dict]:
    """What the SFT job logs, with the held-out loss before training at step 0."""
    records = []
    for step in range(60):
        record = {"train/loss": 2.0 * math.exp(-step / 20), "optim/lr": 1e-3, "time/train": 0.2}
        record["optim/grad_norm"] = 1.0 + 0.1 * math.sin(step)
        if step == 0:
            record["eval/initial_loss"] = 2.5
        if step % 20 == 19:
            record |= {"eval/loss": 1.0 - step / 100, "eval/accuracy": step / 100}
        records.append({"step": step, **record})
    return records


def specs_of(records: list[dict]) -> dict:
    return {spec.name: spec for spec in figure_specs(metric_series(records))}


def drawn_keys(spec) -> set[str]:
    return {line.key for panel in spec.panels for line in panel.lines}


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 1000, path


def test_an_rl_run_with_warmup_gets_one_figure_per_question(tmp_path: Path) -> None:
    write_metrics(tmp_path, rl_records())
    paths = plot_metrics(tmp_path)
    names = [path.name for path in paths]
    assert names == [
        "learning.png",
        "sampling.png",
        "rollouts.png",
        "optimizer.png",
        "time.png",
        "index.html",
    ]
    assert all(path.parent == tmp_path / "plots" for path in paths)
    for path in paths[:-1]:
        assert_png(path)
    specs = specs_of(rl_records())
    assert {"reward/mean", "eval/accuracy", "warmup/loss"} <= drawn_keys(specs["learning"])
    assert [phase.name for phase in specs["learning"].phases] == ["SFT warm-up", "RL"]
    # The learning rate of each phase on its own panel, drawn raw.
    lr_panels = [p for p in specs["optimizer"].panels if p.lines[0].key == "optim/lr"]
    assert [p.title for p in lr_panels] == ["learning rate, SFT warm-up", "learning rate, RL"]
    assert not any(p.lines[0].smooth for p in lr_panels)
    # Evaluations are sparse: raw points, never a moving average.
    accuracy = next(p for p in specs["learning"].panels if p.lines[0].key == "eval/accuracy")
    assert not accuracy.lines[0].smooth and accuracy.unit_range


def test_constant_metrics_get_no_panel_and_a_sync_run_no_staleness(tmp_path: Path) -> None:
    sync = specs_of(rl_records(mode="sync"))
    every_key = set().union(*(drawn_keys(spec) for spec in sync.values()))
    assert "async/staleness" not in every_key and "rollout/stopped" not in every_key
    assert "optim/lr" in every_key  # a constant RL learning rate is still shown
    asynchronous = specs_of(rl_records(mode="async"))
    assert "async/staleness" in drawn_keys(asynchronous["sampling"])


def test_every_axis_is_labelled_and_accuracy_spans_zero_to_one() -> None:
    series = metric_series(rl_records())
    for spec in figure_specs(series):
        figure = draw_figure(spec, series)
        visible = [axes for axes in figure.axes if axes.get_visible()]
        assert len(visible) == len(spec.panels)
        assert figure.get_suptitle() == spec.title
        for axes in visible:
            assert axes.get_xlabel() == "step"
            assert axes.get_ylabel(), (spec.name, axes.get_title())
            assert axes.get_title()
        if spec.name == "learning":
            accuracy = next(a for a in visible if a.get_title() == "held-out accuracy")
            low, high = accuracy.get_ylim()
            assert low <= 0.0 and high >= 1.0


def test_the_warmup_is_marked_where_a_panel_spans_both_phases() -> None:
    series = metric_series(rl_records())
    optimizer = next(spec for spec in figure_specs(series) if spec.name == "optimizer")
    figure = draw_figure(optimizer, series)
    grad_norm = next(a for a in figure.axes if a.get_title() == "gradient norm")
    labels = {text.get_text() for text in grad_norm.texts}
    assert labels == {"SFT warm-up", "RL"}
    # An RL-only panel is not stretched over the warm-up.
    learning = next(spec for spec in figure_specs(series) if spec.name == "learning")
    reward = next(
        a for a in draw_figure(learning, series).axes if a.get_title() == "rollout reward"
    )
    assert reward.get_xlim()[0] > NUM_WARMUP - 5


def test_an_sft_run_plots_the_loss_before_training(tmp_path: Path) -> None:
    write_metrics(tmp_path, sft_records())
    names = [path.name for path in plot_metrics(tmp_path)]
    assert "learning.png" in names and "sampling.png" not in names
    specs = specs_of(sft_records())
    assert specs["learning"].phases == ()
    loss = next(p for p in specs["learning"].panels if p.title == "loss")
    assert [line.key for line in loss.lines] == ["train/loss", "eval/loss", "eval/initial_loss"]
    assert "nats" in loss.ylabel
    figure = draw_figure(specs["learning"], metric_series(sft_records()))
    axes = next(a for a in figure.axes if a.get_title() == "loss")
    before = [line for line in axes.get_lines() if line.get_label() == "held-out, before training"]
    assert len(before) == 1 and list(before[0].get_xdata()) == [0]


def moe_records(*, num_layers: int = 48) -> list[dict]:
    """An RL run of a MoE model: router metrics at every warm-up and RL step."""
    records = rl_records()
    for record in records:
        step = record["step"]
        record["moe/aux_loss"] = 2.0 + 0.5 * math.exp(-step / 20)
        record["moe/max_load"] = 1.2 + 0.8 * math.exp(-step / 30)
        record["moe/entropy"] = 2.0 - 0.01 * step
        for layer in range(num_layers):
            record[f"moe/layer_{layer:02d}/max_load"] = 1.0 + layer / num_layers
            record[f"moe/layer_{layer:02d}/entropy"] = 2.0 - 0.01 * step - layer / 100
    return records


def test_a_moe_run_gets_a_router_figure_with_a_heatmap_row_per_layer(tmp_path: Path) -> None:
    write_metrics(tmp_path, moe_records())
    names = [path.name for path in plot_metrics(tmp_path)]
    assert names[-3:] == ["time.png", "router.png", "index.html"]  # no `other` figure
    assert_png(tmp_path / "plots" / "router.png")
    router = specs_of(moe_records())["router"]
    assert [panel.title for panel in router.panels] == [
        "load-balancing loss",
        "largest expert's load, worst layer",
        "router entropy, mean over layers",
        "largest expert's load by layer",
        "router entropy by layer",
    ]
    load_by_layer = router.panels[3]
    assert load_by_layer.heatmap and len(load_by_layer.lines) == 48
    # Every layer has a row, in layer order, even one whose value never changes.
    assert [line.label for line in load_by_layer.lines] == [f"{i:02d}" for i in range(48)]
    series = metric_series(moe_records())
    figure = draw_figure(router, series)
    heatmap = next(a for a in figure.axes if a.get_title() == "router entropy by layer")
    assert heatmap.get_ylabel() == "layer" and heatmap.get_xlabel() == "step"
    assert [t.get_text() for t in heatmap.get_yticklabels()][:2] == ["00", "04"]
    dashed = [line.get_xdata()[0] for line in heatmap.get_lines()]
    assert dashed == [NUM_WARMUP]  # where RL starts


def test_a_dense_run_gets_no_router_figure() -> None:
    assert "router" not in specs_of(rl_records())


def test_index_lists_exactly_the_figures_written(tmp_path: Path) -> None:
    write_metrics(tmp_path, rl_records())
    stale = tmp_path / "plots" / "reward_group.png"  # from an earlier layout
    stale.parent.mkdir()
    stale.write_bytes(PNG_SIGNATURE)
    paths = plot_metrics(tmp_path)
    index = paths[-1]
    assert index.name == "index.html"
    page = index.read_text()
    linked = re.findall(r'<img src="([^"]+)"', page)
    assert linked == [path.name for path in paths[:-1]]
    assert "Is it learning?" in page and "<p>" in page


def test_keys_and_out_dir_restrict_the_output(tmp_path: Path) -> None:
    write_metrics(tmp_path, sft_records())
    out_dir = tmp_path / "figures"
    paths = plot_metrics(tmp_path / "metrics.jsonl", out_dir=out_dir, keys=["train/loss"])
    assert [path.name for path in paths] == ["learning.png", "index.html"]
    assert sorted(path.name for path in out_dir.iterdir()) == ["index.html", "learning.png"]
    with pytest.raises(ValueError, match=r"\['eval/acc'\].*eval/accuracy"):
        plot_metrics(tmp_path, keys=["eval/acc"])


def test_unknown_metrics_land_in_other(tmp_path: Path) -> None:
    write_metrics(tmp_path, [{"step": s, "env/bonus": float(s), "tokens": 100.0} for s in range(3)])
    paths = plot_metrics(tmp_path)
    assert [path.name for path in paths] == ["other.png", "index.html"]
    assert drawn_keys(specs_of(read_metrics(tmp_path / "metrics.jsonl"))["other"]) == {
        "env/bonus"  # `tokens` never changes
    }


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
