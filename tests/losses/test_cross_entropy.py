from __future__ import annotations

import torch
from torch.testing import assert_close

from tests.losses import loss_and_grad


def test_weighted_nll_by_hand():
    loss, grad = loss_and_grad(
        "cross_entropy", logprobs=[-1.0, -2.0, -0.5, -3.0], inputs={"weights": [1.0, 0.0, 2.0, 1.0]}
    )
    assert_close(loss, torch.tensor([1.0, 0.0, 1.0, 3.0]))
    assert_close(grad, torch.tensor([-1.0, -0.0, -2.0, -1.0]))


def test_real_valued_weights_pass_through_as_the_gradient():
    # forward_backward_custom sends weights = -dL/dlogprobs; the gradient must come back as dL.
    user_grad = [0.25, -1.5, 3.0]
    _, grad = loss_and_grad(
        "cross_entropy", logprobs=[-1.0, -1.0, -1.0], inputs={"weights": [-g for g in user_grad]}
    )
    assert_close(grad, torch.tensor(user_grad))
