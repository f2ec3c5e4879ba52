from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from temper.losses import get_loss, resolve_config
from tests.losses import loss_and_grad

LOGPROBS = [-1.0, -2.0, -0.5]
INPUTS = {"logprobs": [-1.0, -1.5, -1.0], "advantages": [1.0, -1.0, 0.5]}


def test_loss_and_gradient_by_hand():
    loss, grad = loss_and_grad("dro", logprobs=LOGPROBS, inputs=INPUTS, config={"beta": 2.0})
    # drift lp - q = [0, -0.5, 0.5]; loss = -(lp * A - beta / 2 * drift**2)
    assert_close(loss, torch.tensor([1.0, -1.75, 0.5]))
    # grad = -(A - beta * drift) = -([1, -1, 0.5] - [0, -1, 1])
    assert_close(grad, torch.tensor([-1.0, 0.0, 0.5]))


def test_zero_beta_is_reinforce():
    loss, grad = loss_and_grad("dro", logprobs=LOGPROBS, inputs=INPUTS, config={"beta": 0})
    advantages = torch.tensor(INPUTS["advantages"])
    assert_close(loss, -torch.tensor(LOGPROBS) * advantages)
    assert_close(grad, -advantages)


def test_beta_is_required_and_not_negative():
    spec = get_loss("dro")
    with pytest.raises(ValueError, match="beta"):
        resolve_config(spec, None)
    with pytest.raises(ValueError, match=r"beta.*>= 0"):
        resolve_config(spec, {"beta": -0.1})
