"""The SFT warm-up measures held-out accuracy as it goes, without changing what it trains."""

from __future__ import annotations

import dataclasses

import pytest

from temper.rl.job import RLJob
from temper.rl.warmup import SFTWarmup
from tests.rl.conftest import comparable_metrics, tiny_rl_config


def _warmup_records(tmp_path, name, *, eval_every):
    config = tiny_rl_config()
    config.warmup = dataclasses.replace(config.warmup, eval_every=eval_every)
    RLJob(config).run(run_dir=tmp_path / name)
    return [r for r in comparable_metrics(tmp_path / name) if "warmup/loss" in r]


def test_warmup_evaluates_every_eval_every_steps_and_after_the_last(tmp_path, no_plots):
    every_3 = _warmup_records(tmp_path, "every3", eval_every=3)
    only_last = _warmup_records(tmp_path, "last", eval_every=0)
    assert [r["step"] for r in every_3 if "eval/accuracy" in r] == [2, 5, 7]  # 8 steps
    assert [r["step"] for r in only_last if "eval/accuracy" in r] == [7]
    # Evaluating reads the weights only: the warm-up trains exactly the same.
    assert every_3[-1] == only_last[-1]

    def without_evals(records):
        return [{k: v for k, v in r.items() if k != "eval/accuracy"} for r in records]

    assert without_evals(every_3) == without_evals(only_last)


def test_negative_eval_every_is_refused():
    with pytest.raises(ValueError, match=r"SFTWarmup\.Config\.eval_every must be >= 0"):
        SFTWarmup.Config(eval_every=-1)
