from __future__ import annotations

import math

import torch
from torch.testing import assert_close

from tests.losses import loss_and_grad

# Default bounds [0.8, 1.2]: the clipped ratios are 1.0, 1.2, 0.8, 1.1, 1.2, 0.8.
RATIOS = [1.0, 1.5, 0.5, 1.1, 1.5, 0.5]
CLIPPED = torch.tensor([1.0, 1.2, 0.8, 1.1, 1.2, 0.8])
ADVANTAGES = [1.0, 1.0, 1.0, -1.0, -1.0, -1.0]
LOGPROBS = [-1.0, -2.0, -0.5, -1.0, -3.0, -0.25]
SAMPLER_LOGPROBS = [lp - math.log(r) for lp, r in zip(LOGPROBS, RATIOS, strict=True)]
INPUTS = {"logprobs": SAMPLER_LOGPROBS, "advantages": ADVANTAGES}


def test_loss_by_hand():
    loss, _ = loss_and_grad("cispo", logprobs=LOGPROBS, inputs=INPUTS)
    # -clip(ratio) * lp * A
    assert_close(loss, torch.tensor([1.0, 2.4, 0.4, -1.1, -3.6, -0.2]))


def test_gradient_is_clipped_ratio_times_advantage_with_no_gradient_through_the_ratio():
    _, grad = loss_and_grad("cispo", logprobs=LOGPROBS, inputs=INPUTS)
    # Unlike PPO no position is zeroed, and a gradient through the ratio would add
    # -A * ratio * lp at the unclipped positions (0 and 3).
    assert_close(grad, -CLIPPED * torch.tensor(ADVANTAGES))


def test_per_token_thresholds_override_config():
    loss, grad = loss_and_grad(
        "cispo",
        logprobs=LOGPROBS,
        inputs={**INPUTS, "clip_high_threshold": [1.2, 2.0, 1.2, 1.2, 1.2, 1.2]},
        config={"clip_low_threshold": 0.5},
    )
    clipped = torch.tensor([1.0, 1.5, 0.5, 1.1, 1.2, 0.5])
    advantages = torch.tensor(ADVANTAGES)
    assert_close(loss, -clipped * torch.tensor(LOGPROBS) * advantages)
    assert_close(grad, -clipped * advantages)
