"""losses/support.py: the trainer's logprob renormalised over a sampler's support, against
the formula on the logits (values and gradients), and the inputs it refuses."""

from __future__ import annotations

import pytest
import torch

from temper.losses import get_loss, resolve_config
from temper.losses.support import support_logprobs

VOCAB, ROWS = 11, 5


def _case(seed=0):
    """Logits, per-row supports (target first), the [N, K] table and its mask."""
    generator = torch.Generator().manual_seed(seed)
    logits_NV = torch.randn(ROWS, VOCAB, generator=generator, dtype=torch.float64) * 2
    supports = [
        torch.randperm(VOCAB, generator=generator)[: 1 + n].tolist() for n in (0, 2, 4, 6, 10)
    ]
    width = max(len(s) for s in supports)
    targets_NK = torch.tensor([s + [s[0]] * (width - len(s)) for s in supports])
    mask_NK = torch.tensor([[1.0] * len(s) + [0.0] * (width - len(s)) for s in supports])
    temperature_N = torch.tensor([1.0, 0.7, 1.3, 1.0, 0.5], dtype=torch.float64)
    return logits_NV, supports, targets_NK, mask_NK, temperature_N


def test_renormalised_logprob_and_gradient_equal_the_formula_on_the_logits():
    logits_NV, supports, targets_NK, mask_NK, temperature_N = _case()
    logits_NV.requires_grad_()
    # What the trainer hands the loss: log p at temperature 1 of the K targets.
    lp_NK = logits_NV.log_softmax(-1).gather(-1, targets_NK)
    inputs = {"support_mask": mask_NK, "sampler_temperature": temperature_N}
    ours_N = support_logprobs(lp_NK, inputs=inputs)
    weights_N = torch.randn(ROWS, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (grad_ours,) = torch.autograd.grad((ours_N * weights_N).sum(), logits_NV)
    reference = []
    for row, support in enumerate(supports):
        scaled_V = logits_NV[row] / temperature_N[row]
        reference.append(scaled_V[support[0]] - torch.logsumexp(scaled_V[support], dim=0))
    reference_N = torch.stack(reference)
    (grad_reference,) = torch.autograd.grad((reference_N * weights_N).sum(), logits_NV)
    assert torch.allclose(ours_N, reference_N, atol=1e-12)
    assert torch.allclose(grad_ours, grad_reference, atol=1e-12)
    assert ours_N[0] == 0  # a lone kept token has probability 1
    # The gradient checks out against finite differences too (float64).
    assert torch.autograd.gradcheck(
        lambda lp: support_logprobs(lp, inputs=inputs), (lp_NK.detach().requires_grad_(),)
    )


def test_without_temperature_it_is_one_and_plain_targets_pass_through():
    logits_NV, _, targets_NK, mask_NK, _ = _case(seed=2)
    lp_NK = logits_NV.log_softmax(-1).gather(-1, targets_NK)
    ones = {"support_mask": mask_NK, "sampler_temperature": torch.ones(ROWS, dtype=torch.float64)}
    assert torch.equal(
        support_logprobs(lp_NK, inputs={"support_mask": mask_NK}),
        support_logprobs(lp_NK, inputs=ones),
    )
    lp_N = lp_NK[:, 0]
    assert support_logprobs(lp_N, inputs={}) is lp_N


@pytest.mark.parametrize(
    ("shape", "inputs", "message"),
    [
        ("NK", {}, "give 'support_mask'"),
        ("N", {"support_mask": torch.ones(ROWS)}, "need target_tokens of shape"),
        ("NK", {"support_mask": torch.zeros(ROWS, 3)}, "must be 1 in column 0"),
        (
            "NK",
            {"support_mask": torch.ones(ROWS, 3), "sampler_temperature": torch.zeros(ROWS)},
            "must be > 0",
        ),
    ],
)
def test_bad_support_inputs_are_named(shape, inputs, message):
    lp = torch.zeros(ROWS, 3) if shape == "NK" else torch.zeros(ROWS)
    with pytest.raises(ValueError, match=message):
        support_logprobs(lp, inputs=inputs)


@pytest.mark.parametrize(
    "name", ["importance_sampling", "ppo", "cispo", "dro", "gspo", "stable_reinforce"]
)
def test_every_policy_loss_takes_a_support(name):
    spec = get_loss(name)
    assert spec.position_logprobs is support_logprobs
    assert spec.topk_inputs == ("target_tokens", "support_mask")
    assert spec.optional_inputs[-2:] == ("support_mask", "sampler_temperature")
    resolve_config(spec, {"beta": 0.5} if name == "dro" else None)  # config keys unchanged
    assert get_loss("cross_entropy").position_logprobs is None
