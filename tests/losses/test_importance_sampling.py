from __future__ import annotations

import math

import torch
from torch.testing import assert_close

from tests.losses import loss_and_grad

# ratio = exp(lp - q): lp is picked as q + log(ratio) so the ratios are round numbers.
RATIOS = [1.0, 2.0, 0.5, 1.5]
SAMPLER_LOGPROBS = [-1.0, -1.0, -2.0, -0.5]
ADVANTAGES = [1.0, -1.0, 2.0, 0.5]
LOGPROBS = [q + math.log(r) for q, r in zip(SAMPLER_LOGPROBS, RATIOS, strict=True)]


def test_loss_and_gradient_by_hand():
    loss, grad = loss_and_grad(
        "importance_sampling",
        logprobs=LOGPROBS,
        inputs={"logprobs": SAMPLER_LOGPROBS, "advantages": ADVANTAGES},
    )
    # -ratio * A, and d/dlp exp(lp - q) = ratio, so the gradient is -ratio * A as well.
    expected = torch.tensor([-1.0, 2.0, -1.0, -0.75])
    assert_close(loss, expected)
    assert_close(grad, expected)


def test_on_policy_gradient_is_reinforce():
    _, grad = loss_and_grad(
        "importance_sampling",
        logprobs=SAMPLER_LOGPROBS,
        inputs={"logprobs": SAMPLER_LOGPROBS, "advantages": ADVANTAGES},
    )
    assert_close(grad, -torch.tensor(ADVANTAGES))
