"""A run's crafted train state runs no code: `temper train --resume` refuses it by name (and
clears what killed saves left), `temper sample` never unpickles it."""

from __future__ import annotations

import json
from pathlib import Path

from temper.checkpoint.run_state import load_run_state
from temper.cli import main
from temper.config import serialize
from temper.rl.job import RLJob
from tests.checkpoint.crafted import plant_index
from tests.rl.conftest import tiny_rl_config


def _finished_run(tmp_path: Path, *, checkpoint_every: int) -> tuple[Path, RLJob.Config]:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    config = tiny_rl_config(checkpoint_every=checkpoint_every)
    serialize.save_config(run_dir / "config.json", config, recipe=None)
    RLJob(config).run(run_dir=run_dir)
    return run_dir, config


def _train_state_dir(run_dir: Path) -> Path:
    run_id, _, name = load_run_state(run_dir).train_state.removeprefix("tinker://").split("/")
    return run_dir / "checkpoints" / run_id / "weights" / name


def test_resume_refuses_a_crafted_checkpoint_and_clears_killed_saves(
    tmp_path, capsys, no_plots, monkeypatch
):
    run_dir, _ = _finished_run(tmp_path, checkpoint_every=0)
    state_dir = _train_state_dir(run_dir)
    # Make the run resumable again: its run state names a step before the end.
    state_file = run_dir / "run_state" / "state.json"
    saved = json.loads(state_file.read_text())
    state_file.write_text(json.dumps({**saved, "step": saved["step"] - 1}))
    killed = [state_dir.parent / f".step-000099.tmp-{i}" for i in range(2)] + [
        run_dir / ".run_state.tmp-x"
    ]
    for directory in killed:
        directory.mkdir()
    marker = tmp_path / "ran"
    plant_index(state_dir, marker=marker)
    assert main(["train", "--resume", str(run_dir)]) == 1
    error = capsys.readouterr().err
    assert "is refused" in error and str(state_dir) in error
    assert not marker.exists()
    assert not any(directory.exists() for directory in killed)


def test_sample_never_unpickles_a_train_state(tmp_path, capsys, no_plots):
    """`temper sample` reads safetensors and JSON only: a run whose train state is crafted
    samples from its final weights, and a train-state directory is refused by name."""
    run_dir, _ = _finished_run(tmp_path, checkpoint_every=0)
    state_dir = _train_state_dir(run_dir)
    marker = tmp_path / "ran"
    plant_index(state_dir, marker=marker)
    argv = ["sample", "--prompt", "1+2=", "--max-tokens", "3"]
    assert main([*argv, "--model", str(run_dir)]) == 0
    assert "completion" in capsys.readouterr().out
    assert main([*argv, "--model", str(state_dir)]) != 0
    assert str(state_dir) in capsys.readouterr().err
    assert not marker.exists()
