"""gspo: one importance ratio per datum, PPO's clip on it, each token's own gradient."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from temper.losses import get_loss, resolve_config


def run_gspo(logprobs, inputs, *, lengths, config=None):
    """(elementwise loss, d sum(loss) / d logprobs) for datums of `lengths`, concatenated."""
    spec = get_loss("gspo")
    logprobs_N = torch.tensor(logprobs, dtype=torch.float32, requires_grad=True)
    inputs_N = {key: torch.tensor(value, dtype=torch.float32) for key, value in inputs.items()}
    for name, default in spec.input_defaults.items():
        inputs_N.setdefault(name, default(inputs_N))
    segments_N = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    loss_N = spec.fn(
        logprobs_N=logprobs_N,
        inputs=inputs_N,
        config=resolve_config(spec, config),
        segments_N=segments_N,
    )
    loss_N.sum().backward()
    return loss_N.detach(), logprobs_N.grad


def direct(logprobs, sampler, advantages, mask, *, low=0.8, high=1.2):
    """One datum computed from the formula, with autograd: the reference."""
    lp = torch.tensor(logprobs, requires_grad=True)
    q, a, m = torch.tensor(sampler), torch.tensor(advantages), torch.tensor(mask) != 0
    log_ratio = (lp.detach() - q)[m].mean() if m.any() else torch.tensor(0.0)
    ratio = torch.exp(log_ratio + lp - lp.detach())
    loss = -torch.minimum(ratio * a, ratio.clamp(low, high) * a)
    loss.sum().backward()
    return loss.detach(), lp.grad, float(torch.exp(log_ratio))


# Two datums: a 3-token prompt (placeholder sampler logprobs 0, A = 0) then sampled tokens.
FIRST = {
    "logprobs": [-1.0, -0.5, -2.0, -1.1, -0.7],
    "sampler": [0.0, 0.0, -2.2, -1.0, -0.8],
    "advantages": [0.0, 0.0, 1.0, 1.0, 1.0],
    "mask": [0.0, 0.0, 1.0, 1.0, 1.0],
}
SECOND = {
    "logprobs": [-0.3, -1.5, -2.5, -0.2],
    "sampler": [0.0, -1.0, -2.0, -0.1],
    "advantages": [0.0, -0.5, -0.5, -0.5],
    "mask": [0.0, 1.0, 1.0, 1.0],
}


def concatenated(*datums, with_mask=True):
    inputs = {
        "logprobs": [v for d in datums for v in d["sampler"]],
        "advantages": [v for d in datums for v in d["advantages"]],
    }
    if with_mask:
        inputs["sequence_ratio_mask"] = [v for d in datums for v in d["mask"]]
    logprobs = [v for d in datums for v in d["logprobs"]]
    return logprobs, inputs


@pytest.mark.parametrize("with_mask", [True, False], ids=["mask", "default-mask"])
def test_one_ratio_per_datum_matches_the_direct_computation(with_mask):
    logprobs, inputs = concatenated(FIRST, SECOND, with_mask=with_mask)
    loss, grad = run_gspo(logprobs, inputs, lengths=[5, 4])
    expected = [
        direct(d["logprobs"], d["sampler"], d["advantages"], d["mask"]) for d in (FIRST, SECOND)
    ]
    assert_close(loss, torch.cat([e[0] for e in expected]))
    assert_close(grad, torch.cat([e[1] for e in expected]))


def test_gradient_is_minus_sequence_ratio_times_advantage_inside_the_bounds():
    logprobs, inputs = concatenated(FIRST)
    _, grad = run_gspo(logprobs, inputs, lengths=[5])
    # Sequence log ratio: mean(0.2, -0.1, 0.1) over the sampled tokens; s = exp(0.0667) < 1.2.
    s = math.exp((0.2 - 0.1 + 0.1) / 3)
    assert_close(grad, torch.tensor([0.0, 0.0, -s, -s, -s]))
    # The loss is a sum over tokens: each sampled token contributes -s * A.
    loss, _ = run_gspo(logprobs, inputs, lengths=[5])
    assert_close(loss.sum(), torch.tensor(-3 * s))


def test_clipping_acts_on_the_sequence_ratio():
    # Sequence ratio e^0.5 = 1.65 > 1.2 with A > 0: clipped, so no token gets a gradient,
    # although one token's own ratio (e^-0.1) is inside the bounds.
    logprobs = [-1.0, -1.1, -0.4]
    inputs = {"logprobs": [-2.0, -1.0, -1.0], "advantages": [1.0, 1.0, 1.0]}
    loss, grad = run_gspo(logprobs, inputs, lengths=[3])
    assert_close(loss, torch.full((3,), -1.2))
    assert_close(grad, torch.zeros(3))
    # Wider bounds from the config: unclipped, gradient -s * A.
    _, grad = run_gspo(
        logprobs, inputs, lengths=[3], config={"clip_low_threshold": 0.5, "clip_high_threshold": 2}
    )
    assert_close(grad, torch.full((3,), -math.exp(0.5)))
    # Per-token bounds win over the config, position by position.
    _, grad = run_gspo(logprobs, {**inputs, "clip_high_threshold": [1.2, 2.0, 1.2]}, lengths=[3])
    assert_close(grad, torch.tensor([0.0, -math.exp(0.5), 0.0]))


def test_only_masked_positions_enter_the_ratio_and_an_empty_mask_gives_one():
    logprobs = [-1.0, -1.0, -1.0]
    inputs = {"logprobs": [-5.0, -1.0, -1.0], "advantages": [1.0, 1.0, 1.0]}
    # Position 0 (log ratio 4) is outside the mask: s = 1.
    _, grad = run_gspo(logprobs, {**inputs, "sequence_ratio_mask": [0.0, 1.0, 1.0]}, lengths=[3])
    assert_close(grad, torch.full((3,), -1.0))
    # No position in the mask: s = 1 (log ratio 0), not NaN.
    loss, grad = run_gspo(logprobs, {**inputs, "sequence_ratio_mask": [0.0] * 3}, lengths=[3])
    assert_close(loss, torch.full((3,), -1.0))
    assert_close(grad, torch.full((3,), -1.0))
    # Default mask with all-zero advantages: s = 1, loss and gradient 0.
    loss, grad = run_gspo(logprobs, {**inputs, "advantages": [0.0] * 3}, lengths=[3])
    assert_close(loss, torch.zeros(3))
    assert_close(grad, torch.zeros(3))


def test_config_keys_are_ppos():
    spec = get_loss("gspo")
    assert resolve_config(spec, None) == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    with pytest.raises(ValueError, match="valid keys: clip_low_threshold, clip_high_threshold"):
        resolve_config(spec, {"beta": 0.1})
    with pytest.raises(ValueError, match="must be <= clip_high_threshold"):
        resolve_config(spec, {"clip_low_threshold": 1.5})
