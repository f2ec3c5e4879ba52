"""The demo job end to end: `temper train` on the smoke recipe learns and writes its outputs."""

from __future__ import annotations

import json

from temper.checkpoint.hf import load_pretrained
from temper.cli import main
from temper.config import load_config
from temper.observability import read_metrics


def test_smoke_recipe_learns_and_writes_run_dir(tmp_path):
    run_dir = tmp_path / "run"
    argv = ["train", "sum_digits_smoke", "--run-dir", str(run_dir), "--seed", "1"]
    argv += ["--metrics.display", "none", "--eval_problems", "32"]
    assert main(argv) == 0

    records = read_metrics(run_dir / "metrics.jsonl")
    losses = [r["train/loss"] for r in records if "train/loss" in r]
    assert len(losses) == 60
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    # From random init the answer loss starts near ln(29) = 3.4; 60 steps bring it well down.
    assert first > 2.5 and last < 0.75 * first, (first, last)
    assert [r["eval/accuracy"] for r in records if "eval/accuracy" in r]

    loaded = load_config(run_dir / "config.json")
    assert loaded.recipe == "sum_digits_smoke"
    assert loaded.config.seed == 1 and loaded.config.eval_problems == 32
    assert (run_dir / "plots" / "loss.png").is_file()
    assert load_pretrained(run_dir / "model").config.vocab_size == 29
    saved = json.loads((run_dir / "config.json").read_text())
    assert saved["config"]["steps"] == 60


def test_missing_model_directory_is_a_clean_error_and_leaves_no_run(tmp_path, capsys):
    run_dir = tmp_path / "run"
    argv = ["train", "sum_digits_smoke", "--run-dir", str(run_dir)]
    assert main([*argv, "--model.path", str(tmp_path / "nowhere")]) == 1
    assert "is missing" in capsys.readouterr().err
    assert not run_dir.exists()


def test_config_file_reproduces_the_run_exactly(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    argv = ["--metrics.display", "none", "--export", "none", "--steps", "8", "--eval_every", "4"]
    assert main(["train", "sum_digits_smoke", "--run-dir", str(first), *argv]) == 0
    config_file = str(first / "config.json")
    assert main(["train", "--config-file", config_file, "--run-dir", str(second)]) == 0

    def curves(run_dir):
        return [
            {k: v for k, v in record.items() if not k.startswith(("time", "train/tokens"))}
            for record in read_metrics(run_dir / "metrics.jsonl")
        ]

    assert curves(first) == curves(second)
    assert (first / "config.json").read_text() == (second / "config.json").read_text()
