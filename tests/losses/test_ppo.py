from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from temper.losses import get_loss, resolve_config
from tests.losses import loss_and_grad

# Default bounds [0.8, 1.2]. Each position is one case of the clipped surrogate:
#   ratio 1.0, A +1: inside the bounds            -> -1.0,          grad -ratio*A = -1.0
#   ratio 1.5, A +1: above high, pushed higher    -> -1.2 (clipped), grad 0
#   ratio 0.5, A +1: below low, pushed back up    -> -0.5,          grad -0.5
#   ratio 1.1, A -1: inside the bounds            -> +1.1,          grad +1.1
#   ratio 1.5, A -1: above high, pushed back down -> +1.5,          grad +1.5
#   ratio 0.5, A -1: below low, pushed lower      -> +0.8 (clipped), grad 0
#   ratio 1.5, A  0: no signal                    ->  0,            grad 0
RATIOS = [1.0, 1.5, 0.5, 1.1, 1.5, 0.5, 1.5]
ADVANTAGES = [1.0, 1.0, 1.0, -1.0, -1.0, -1.0, 0.0]
SAMPLER_LOGPROBS = [-1.0, -2.0, -0.5, -1.0, -3.0, -0.25, -1.0]
LOGPROBS = [q + math.log(r) for q, r in zip(SAMPLER_LOGPROBS, RATIOS, strict=True)]
INPUTS = {"logprobs": SAMPLER_LOGPROBS, "advantages": ADVANTAGES}


def test_clipped_surrogate_and_gradient_by_hand():
    loss, grad = loss_and_grad("ppo", logprobs=LOGPROBS, inputs=INPUTS)
    assert_close(loss, torch.tensor([-1.0, -1.2, -0.5, 1.1, 1.5, 0.8, 0.0]))
    assert_close(grad, torch.tensor([-1.0, 0.0, -0.5, 1.1, 1.5, 0.0, 0.0]))


def test_config_bounds():
    loss, grad = loss_and_grad(
        "ppo",
        logprobs=LOGPROBS,
        inputs=INPUTS,
        config={"clip_low_threshold": 0.4, "clip_high_threshold": 2.0},
    )
    # Nothing is past the wider bounds, so PPO is plain importance sampling here.
    ratio_times_advantage = torch.tensor(RATIOS) * torch.tensor(ADVANTAGES)
    assert_close(loss, -ratio_times_advantage)
    assert_close(grad, -ratio_times_advantage)


def test_per_token_thresholds_override_config_position_by_position():
    # Only the high bound is given per token; the low bound stays the config's 0.8.
    high = [1.2, 2.0, 1.2, 1.2, 1.2, 1.2, 1.2]
    loss, grad = loss_and_grad(
        "ppo", logprobs=LOGPROBS, inputs={**INPUTS, "clip_high_threshold": high}
    )
    # Position 1 (ratio 1.5, A +1) is now inside its bound; the rest are unchanged.
    assert_close(loss, torch.tensor([-1.0, -1.5, -0.5, 1.1, 1.5, 0.8, 0.0]))
    assert_close(grad, torch.tensor([-1.0, -1.5, -0.5, 1.1, 1.5, 0.0, 0.0]))

    low = [0.8, 0.8, 0.8, 0.8, 0.8, 0.4, 0.8]
    loss, grad = loss_and_grad(
        "ppo", logprobs=LOGPROBS, inputs={**INPUTS, "clip_low_threshold": low}
    )
    # Position 5 (ratio 0.5, A -1) is now inside its bound.
    assert_close(loss, torch.tensor([-1.0, -1.2, -0.5, 1.1, 1.5, 0.5, 0.0]))
    assert_close(grad, torch.tensor([-1.0, 0.0, -0.5, 1.1, 1.5, 0.5, 0.0]))


def test_crossed_bounds_are_rejected():
    with pytest.raises(ValueError, match=r"clip_low_threshold.*clip_high_threshold"):
        resolve_config(get_loss("ppo"), {"clip_low_threshold": 1.3})
