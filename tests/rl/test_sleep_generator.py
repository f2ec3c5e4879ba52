"""`--sleep_generator`: the RL job's generator lets its KV cache go during each
forward_backward and gets it back (zeros) to sample; the run is bitwise the same."""

from __future__ import annotations

from temper.rl.job import RLJob
from tests.rl.conftest import comparable_metrics


def test_a_sleeping_generator_trains_exactly_like_an_awake_one(tmp_path, tiny_config, no_plots):
    awake, sleeping = tmp_path / "awake", tmp_path / "sleeping"
    RLJob(tiny_config(steps=3)).run(run_dir=awake)
    RLJob(tiny_config(steps=3, sleep_generator=True)).run(run_dir=sleeping)
    assert comparable_metrics(sleeping) == comparable_metrics(awake)
    assert len(comparable_metrics(awake)) == 8 + 3  # warm-up and RL steps, all logged
