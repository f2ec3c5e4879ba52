"""Datums built from rollouts line up with the tokens they score."""

from __future__ import annotations

import pytest

from temper.rl.rollout import Trajectory, policy_datum, supervised_datum


def test_policy_datum_puts_advantages_and_logprobs_on_completion_targets():
    trajectory = Trajectory(
        prompt=[5, 6, 7],
        completion=[8, 2],
        sampler_logprobs=[-0.5, -0.1],
        reward=1.0,
        stop_reason="stop",
        metrics={},
    )
    datum = policy_datum(trajectory, advantage=0.25)
    assert datum.model_input.to_ints() == [5, 6, 7, 8]
    inputs = {name: value.tolist() for name, value in datum.loss_fn_inputs.items()}
    assert inputs["target_tokens"] == [6, 7, 8, 2]
    assert inputs["logprobs"] == pytest.approx([0.0, 0.0, -0.5, -0.1])
    assert inputs["advantages"] == [0.0, 0.0, 0.25, 0.25]


def test_supervised_datum_weights_only_the_completion():
    datum = supervised_datum([5, 6], [7, 2], weight=0.5)
    assert datum.loss_fn_inputs["weights"].tolist() == [0.0, 0.5, 0.5]
    assert datum.loss_fn_inputs["target_tokens"].tolist() == [6, 7, 2]
