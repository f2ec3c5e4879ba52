"""SFT full-state resume: a run stopped after a checkpoint and resumed with
`temper train --resume` ends bitwise equal to one that never stopped, on a task and on
conversations, and metrics.jsonl continues the same curve with each step once."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from recipes.sft_conversations import sft_conversations
from recipes.sum_digits import sum_digits_smoke
from temper.checkpoint.run_state import load_run_state
from temper.cli import main
from temper.config import serialize
from temper.job import RunCheckpoints, run_checkpoints
from temper.observability import read_metrics
from temper.sft.job import SFTJob


class Crash(RuntimeError):
    pass


def _config(source: str) -> SFTJob.Config:
    config = sum_digits_smoke() if source == "task" else sft_conversations()
    config.steps, config.eval_every, config.checkpoint_every = 7, 3, 2
    config.batch_size, config.eval_problems, config.export = 8, 16, "none"
    config.metrics.display = "none"
    return config


def _curve(run_dir) -> list[dict]:
    return [
        {k: v for k, v in r.items() if not k.startswith(("time", "train/tokens_per_s"))}
        for r in read_metrics(run_dir / "metrics.jsonl")
    ]


def _final_weights(run_dir) -> dict[str, torch.Tensor]:
    (final,) = (run_dir / "checkpoints").glob("*/sampler_weights/final")
    weights = {}
    for file in sorted(final.glob("*.safetensors")):
        weights |= load_file(file)
    return weights


@pytest.mark.parametrize("source", ["task", "conversations"])
def test_resumed_sft_run_equals_uninterrupted(tmp_path, monkeypatch, capsys, source):
    monkeypatch.setattr(
        run_checkpoints, "plot_metrics", lambda run_dir: [run_dir / "plots" / "none.png"]
    )
    config = _config(source)
    straight = tmp_path / "straight"
    SFTJob(config).run(run_dir=straight)

    stopped = tmp_path / "stopped"
    stopped.mkdir()
    serialize.save_config(stopped / "config.json", config, recipe=None)
    original = RunCheckpoints.step_done

    def step_done_then_crash(self, steps_done, state):
        original(self, steps_done, state)
        if steps_done == 4:
            raise Crash("stopped after step 4")

    with monkeypatch.context() as patch:
        patch.setattr(RunCheckpoints, "step_done", step_done_then_crash)
        with pytest.raises(Crash):
            SFTJob(config).run(run_dir=stopped)
    assert load_run_state(stopped).step == 4

    capsys.readouterr()
    assert main(["train", "--resume", str(stopped)]) == 0
    out = capsys.readouterr().out
    assert "at step 4 of 7 (its last checkpoint; held-out loss before training was" in out
    assert [r["step"] for r in _curve(stopped)] == list(range(7))
    assert _curve(stopped) == _curve(straight)
    a, b = _final_weights(straight), _final_weights(stopped)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert len(list((stopped / "checkpoints").glob("*/weights/*"))) == 1  # only the last


def test_resuming_a_finished_run_is_a_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(
        run_checkpoints, "plot_metrics", lambda run_dir: [run_dir / "plots" / "none.png"]
    )
    config = _config("task")
    config.steps, config.checkpoint_every = 2, 0
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    serialize.save_config(run_dir / "config.json", config, recipe=None)
    SFTJob(config).run(run_dir=run_dir)
    assert main(["train", "--resume", str(run_dir)]) != 0
    assert "already finished all 2 steps" in capsys.readouterr().err
