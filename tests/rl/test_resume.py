"""Full-state resume: a run that stops and is resumed (`temper train --resume`) ends bitwise
equal to one that never stopped, and its metrics.jsonl is the same curve, each step once."""

from __future__ import annotations

import time

import pytest
import torch

from temper.checkpoint.run_state import load_run_state
from temper.cli import main
from temper.client.sampling_client import SamplingClient
from temper.config import serialize
from temper.job import RunCheckpoints
from temper.rl.envs import GuessNumber
from temper.rl.episodes import EpisodeRunner
from temper.rl.job import RLJob
from tests.rl.conftest import comparable_metrics, final_weights, tiny_rl_config


class Crash(RuntimeError):
    pass


def _crash_after(monkeypatch, steps_done: int) -> None:
    original = RunCheckpoints.step_done

    def step_done(self, done: int, state) -> None:
        original(self, done, state)
        if done == steps_done:
            raise Crash(f"stopped after step {done - 1}")

    monkeypatch.setattr(RunCheckpoints, "step_done", step_done)


def _final_weights(run_dir):
    state = load_run_state(run_dir)
    assert state.step == 14  # 8 warm-up + 6 RL steps, the last checkpoint is the end

    class Result:
        sampler_path = None

    sampler_dirs = sorted((run_dir / "checkpoints").glob("*/sampler_weights/final"))
    assert len(sampler_dirs) == 1
    Result.sampler_path = f"tinker://{sampler_dirs[0].parent.parent.name}/sampler_weights/final"
    return final_weights(run_dir, Result)


@pytest.mark.parametrize(
    ("mode", "crash_at", "every", "lr_schedule"),
    [
        ("sync", 10, 3, "constant"),
        ("async", 12, 3, "constant"),
        ("sync", 5, 3, "constant"),
        # The hardest case: the last checkpoint inside the SFT warm-up, then warm-up and RL
        # steps after it (here also steps of RL logged and lost), cosine learning rates.
        ("async", 9, 5, "cosine"),
        ("sync", 7, 5, "cosine"),
    ],
    ids=[
        "sync-in-rl",
        "async-in-rl",
        "in-warmup",
        "warmup-checkpoint-rl-crash",
        "in-warmup-cosine",
    ],
)
def test_resumed_run_equals_uninterrupted(
    tmp_path, monkeypatch, no_plots, capsys, mode, crash_at, every, lr_schedule
):
    config = tiny_rl_config(
        mode=mode, checkpoint_every=every, kl_coef=0.05, lr_schedule=lr_schedule
    )
    _check_resume(tmp_path, monkeypatch, config, crash_at=crash_at)
    resumed_at = crash_at // every * every
    assert f"at step {resumed_at} of 14 (its last checkpoint)" in capsys.readouterr().out


def test_resumed_multiturn_run_equals_uninterrupted(tmp_path, monkeypatch, no_plots):
    # Episodes in lockstep (turn_batching="by_turn"): each turn decodes as one batch, so the
    # logprobs do not depend on when env steps return.
    config = tiny_rl_config(
        env=GuessNumber.Config(low=1, high=16),
        episodes=EpisodeRunner.Config(max_turns=4, max_context=32, turn_batching="by_turn"),
        max_tokens=4,
        eval_problems=8,
        mode="async",
        checkpoint_every=5,
        kl_coef=0.05,
        lr_schedule="cosine",
    )
    _check_resume(tmp_path, monkeypatch, config, crash_at=12)


def _check_resume(tmp_path, monkeypatch, config, *, crash_at: int) -> None:
    """A run stopped after `crash_at` steps and resumed equals one that never stopped."""
    straight = tmp_path / "straight"
    RLJob(config).run(run_dir=straight)

    stopped = tmp_path / "stopped"
    stopped.mkdir()
    serialize.save_config(stopped / "config.json", config, recipe=None)
    with monkeypatch.context() as patch:
        _crash_after(patch, crash_at)
        with pytest.raises(Crash):
            RLJob(config).run(run_dir=stopped)
    every = config.checkpoint_every
    last_checkpoint = crash_at // every * every
    assert load_run_state(stopped).step == last_checkpoint
    logged = [r["step"] for r in comparable_metrics(stopped)]
    assert logged[-1] == crash_at - 1  # steps after the checkpoint were logged, then lost

    assert main(["train", "--resume", str(stopped)]) == 0
    assert comparable_metrics(stopped) == comparable_metrics(straight)
    a, b = _final_weights(straight), _final_weights(stopped)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # Only the last train state is kept.
    assert len(list((stopped / "checkpoints").glob("*/weights/*"))) == 1


def test_a_run_does_not_depend_on_how_its_sample_calls_are_timed(tmp_path, monkeypatch, no_plots):
    # The race behind resumed runs that differed at rounding level: a free sampler worker
    # started a step's first `sample` alone while the others were still being sent, and the
    # engine's logprobs depend on the batch. Slow `sample` calls force that split every time;
    # the step's requests still decode as one batch (SamplingClient.batch()), so nothing moves.
    config = tiny_rl_config(mode="async", kl_coef=0.05)
    RLJob(config).run(run_dir=tmp_path / "plain")
    sample = SamplingClient.sample

    def slow_sample(self, *args, **kwargs):
        future = sample(self, *args, **kwargs)
        time.sleep(0.02)
        return future

    monkeypatch.setattr(SamplingClient, "sample", slow_sample)
    RLJob(config).run(run_dir=tmp_path / "slow")
    assert comparable_metrics(tmp_path / "slow") == comparable_metrics(tmp_path / "plain")
    a, b = _final_weights(tmp_path / "plain"), _final_weights(tmp_path / "slow")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_needs_a_checkpoint_and_no_other_options(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    serialize.save_config(run_dir / "config.json", tiny_rl_config(), recipe=None)
    assert main(["train", "--resume", str(run_dir)]) == 1
    assert "no checkpoint to resume from" in capsys.readouterr().err
    assert main(["train", "--resume", str(run_dir), "--rl.steps", "3"]) == 2
    assert "takes no other options" in capsys.readouterr().err
    assert main(["train", "--resume", str(tmp_path / "missing")]) == 2
    assert "no run there" in capsys.readouterr().err


def test_resuming_a_finished_run_says_so_and_changes_nothing(tmp_path, capsys, no_plots):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    config = tiny_rl_config(checkpoint_every=0)
    serialize.save_config(run_dir / "config.json", config, recipe=None)
    RLJob(config).run(run_dir=run_dir)
    before = sorted(path.relative_to(run_dir) for path in run_dir.rglob("*"))
    assert main(["train", "--resume", str(run_dir)]) == 1
    assert "the run already finished all 14 steps; nothing to resume" in capsys.readouterr().err
    assert sorted(path.relative_to(run_dir) for path in run_dir.rglob("*")) == before
