from __future__ import annotations

import torch
from torch.testing import assert_close

from temper.losses import get_loss, resolve_config
from temper.models.common.logprobs import target_logprobs
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


def test_missing_weights_default_to_ones():
    spec = get_loss("cross_entropy")
    for targets in (torch.tensor([3, 1]), torch.tensor([[3, 1], [0, 2]])):
        weights = spec.input_defaults["weights"]({"target_tokens": targets})
        assert weights.dtype == torch.float32 and torch.equal(weights, torch.ones(targets.shape))


def test_top_k_targets_against_gather_of_log_softmax():
    # K candidate tokens per position with their weights (top-K distillation): the loss is
    # -sum_{t,k} w_tk log p(x_tk), each candidate scored by the one softmax of its position.
    generator = torch.Generator().manual_seed(0)
    hidden_TD = torch.randn(5, 8, generator=generator, requires_grad=True)
    weight_VD = torch.randn(11, 8, generator=generator)
    targets_TK = torch.randint(0, 11, (5, 3), generator=generator)
    weights_TK = torch.rand(5, 3, generator=generator)
    weights_TK[4] = 0.0  # a padding row: no loss, its logprobs still computed

    logprobs_TK = target_logprobs(hidden_TD, weight_VD, targets_TK)
    spec = get_loss("cross_entropy")
    inputs = {"target_tokens": targets_TK, "weights": weights_TK}
    loss_TK = spec.fn(logprobs_N=logprobs_TK, inputs=inputs, config=resolve_config(spec, None))
    loss_TK.sum().backward()
    got = (loss_TK.detach(), hidden_TD.grad.clone())

    hidden_TD.grad = None
    reference_TK = torch.log_softmax(hidden_TD @ weight_VD.T, dim=-1).gather(-1, targets_TK)
    expected = -(weights_TK * reference_TK).sum()
    expected.backward()
    assert got[0].shape == (5, 3)
    assert_close(got[0].sum(), expected.detach())
    assert_close(got[0], -(weights_TK * reference_TK).detach())
    assert_close(got[1], hidden_TD.grad)
