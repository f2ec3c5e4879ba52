"""KL penalty to the initial policy: the estimators against hand-computed values, the shaping,
and that a nonzero coefficient changes the update."""

from __future__ import annotations

import math

import pytest
import torch

from temper.rl.job import RLJob
from temper.rl.kl import kl_estimate, kl_penalty
from temper.rl.rollout import Trajectory
from tests.rl.conftest import comparable_metrics, final_weights, tiny_rl_config


def test_estimators_match_hand_computed_values():
    # d = log pi - log pi_ref at three sampled tokens
    d = torch.tensor([0.5, -0.25, 0.0], dtype=torch.float64)
    assert kl_estimate(d, estimator="k1").tolist() == [0.5, -0.25, 0.0]
    expected_k3 = [math.exp(-0.5) - 1 + 0.5, math.exp(0.25) - 1 - 0.25, 0.0]
    assert kl_estimate(d, estimator="k3").tolist() == pytest.approx(expected_k3, abs=1e-15)
    assert (kl_estimate(torch.linspace(-3, 3, 61), estimator="k3") >= 0).all()
    with pytest.raises(ValueError, match="'k1' or 'k3'"):
        kl_estimate(d, estimator="k2")


def test_penalty_is_centered_per_token_and_scaled_by_the_coefficient():
    trajectories = [
        Trajectory([1, 2], [3, 4], [-1.0, -2.0], 1.0, "stop", {}),
        Trajectory([1, 2], [5], [-0.5], 0.0, "stop", {}),
    ]
    # compute_logprobs answers for prompt + completion: None, then one per later token.
    references = [[None, -0.1, -1.5, -1.0], [None, -0.1, -1.0]]
    result = kl_penalty(trajectories, references, coef=0.1, estimator="k1")
    # d = sampler - reference = [0.5, -1.0], [0.5]; mean 0
    assert result.penalties == [pytest.approx([0.05, -0.1]), pytest.approx([0.05])]
    assert result.metrics["kl/k1"] == pytest.approx(0.0)
    k3 = [math.exp(-0.5) - 0.5, math.exp(1.0) - 2.0, math.exp(-0.5) - 0.5]
    assert result.metrics["kl/k3"] == pytest.approx(sum(k3) / 3)


def test_kl_coef_changes_the_update_and_logs_kl(tmp_path, no_plots):
    plain = RLJob(tiny_rl_config()).run(run_dir=tmp_path / "plain")
    penalized = RLJob(tiny_rl_config(kl_coef=0.5, kl_estimator="k1")).run(run_dir=tmp_path / "kl")
    a, b = final_weights(tmp_path / "plain", plain), final_weights(tmp_path / "kl", penalized)
    assert any(not torch.equal(a[k], b[k]) for k in a)
    trained = [r for r in comparable_metrics(tmp_path / "kl") if "kl/k3" in r]
    assert trained and all(r["kl/k3"] >= 0 for r in trained)
    assert trained[0]["kl/k3"] == pytest.approx(0.0, abs=1e-5)  # the first step is on the reference
    assert max(r["kl/k3"] for r in trained) > 0
