"""The chunked target-logprob function against a plain log_softmax, values and gradients."""

from __future__ import annotations

import pytest
import torch

from temper.models.common.logprobs import target_logprobs


def _reference(hidden_BTD, weight_VD, targets_BT, temperature):
    logits_BTV = (hidden_BTD @ weight_VD.T).float() / temperature
    return torch.log_softmax(logits_BTV, dim=-1).gather(-1, targets_BT[..., None]).squeeze(-1)


def _inputs(*, dtype=torch.float32, seed=0, V=53):
    generator = torch.Generator().manual_seed(seed)
    hidden_BTD = torch.randn(3, 7, 16, generator=generator).to(dtype)
    weight_VD = torch.randn(V, 16, generator=generator).to(dtype)
    targets_BT = torch.randint(0, V, (3, 7), generator=generator)
    return hidden_BTD, weight_VD, targets_BT


@pytest.mark.parametrize("chunk_bytes", [1, 53 * 4 * 5, 2**30], ids=["row", "5-rows", "all"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_and_gradients_match_log_softmax(chunk_bytes, temperature):
    hidden_BTD, weight_VD, targets_BT = _inputs()
    hidden_BTD.requires_grad_(True)
    weight_VD.requires_grad_(True)
    grad_BT = torch.randn(3, 7, generator=torch.Generator().manual_seed(5))

    logprobs_BT = target_logprobs(
        hidden_BTD, weight_VD, targets_BT, temperature=temperature, chunk_bytes=chunk_bytes
    )
    (logprobs_BT * grad_BT).sum().backward()
    got = (logprobs_BT.detach(), hidden_BTD.grad.clone(), weight_VD.grad.clone())

    hidden_BTD.grad = weight_VD.grad = None
    expected_BT = _reference(hidden_BTD, weight_VD, targets_BT, temperature)
    (expected_BT * grad_BT).sum().backward()

    assert got[0].dtype == torch.float32 and got[0].shape == (3, 7)
    torch.testing.assert_close(got[0], expected_BT.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(got[1], hidden_BTD.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[2], weight_VD.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk_bytes", [1, 53 * 4 * 5, 2**30], ids=["row", "5-rows", "all"])
def test_k_targets_per_position_match_gather_of_log_softmax(chunk_bytes):
    # Top-K distillation scores K candidate tokens at each position from one softmax.
    hidden_BTD, weight_VD, _ = _inputs(seed=7)
    hidden_BTD.requires_grad_(True)
    weight_VD.requires_grad_(True)
    generator = torch.Generator().manual_seed(8)
    targets_BTK = torch.randint(0, 53, (3, 7, 4), generator=generator)
    grad_BTK = torch.randn(3, 7, 4, generator=generator)

    logprobs_BTK = target_logprobs(hidden_BTD, weight_VD, targets_BTK, chunk_bytes=chunk_bytes)
    (logprobs_BTK * grad_BTK).sum().backward()
    got = (logprobs_BTK.detach(), hidden_BTD.grad.clone(), weight_VD.grad.clone())

    hidden_BTD.grad = weight_VD.grad = None
    logits_BTV = (hidden_BTD @ weight_VD.T).float()
    expected_BTK = torch.log_softmax(logits_BTV, dim=-1).gather(-1, targets_BTK)
    (expected_BTK * grad_BTK).sum().backward()

    assert got[0].shape == (3, 7, 4)
    torch.testing.assert_close(got[0], expected_BTK.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(got[1], hidden_BTD.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[2], weight_VD.grad, rtol=1e-5, atol=1e-5)


def test_same_inputs_and_chunking_are_deterministic():
    hidden_BTD, weight_VD, targets_BT = _inputs(seed=2)
    first = target_logprobs(hidden_BTD, weight_VD, targets_BT, chunk_bytes=200)
    second = target_logprobs(hidden_BTD.clone(), weight_VD.clone(), targets_BT, chunk_bytes=200)
    assert torch.equal(first, second)
    whole = target_logprobs(hidden_BTD, weight_VD, targets_BT, chunk_bytes=2**30)
    torch.testing.assert_close(first, whole, rtol=1e-6, atol=1e-6)


def test_bf16_weights_give_fp32_logprobs_close_to_reference():
    hidden_BTD, weight_VD, targets_BT = _inputs(dtype=torch.bfloat16, seed=3)
    logprobs_BT = target_logprobs(hidden_BTD, weight_VD, targets_BT)
    assert logprobs_BT.dtype == torch.float32
    expected_BT = _reference(hidden_BTD, weight_VD, targets_BT, 1.0)
    torch.testing.assert_close(logprobs_BT, expected_BT, rtol=0, atol=1e-5)


def test_only_hidden_needs_grad():
    hidden_BTD, weight_VD, targets_BT = _inputs(seed=4)
    hidden_BTD.requires_grad_(True)
    target_logprobs(hidden_BTD, weight_VD, targets_BT).sum().backward()
    assert hidden_BTD.grad is not None and weight_VD.grad is None


def test_bad_arguments_are_named():
    hidden_BTD, weight_VD, targets_BT = _inputs()
    with pytest.raises(ValueError, match="temperature must be > 0"):
        target_logprobs(hidden_BTD, weight_VD, targets_BT, temperature=0.0)
    with pytest.raises(ValueError, match="targets shape"):
        target_logprobs(hidden_BTD, weight_VD, targets_BT[:, :3])
    with pytest.raises(ValueError, match="targets shape"):
        target_logprobs(hidden_BTD, weight_VD, targets_BT[..., None, None])


@pytest.mark.parametrize("chunk_bytes", [53 * 4 * 5, 2**30], ids=["5-rows", "all"])
def test_a_retained_graph_gives_the_same_gradients_twice(chunk_bytes):
    # The lone chunk's saved log-softmax becomes the gradient in place; a second backward
    # must recompute it, not reuse the overwritten buffer.
    hidden_BTD, weight_VD, targets_BT = _inputs(seed=6)
    hidden_BTD.requires_grad_(True)
    weight_VD.requires_grad_(True)
    logprobs_BT = target_logprobs(hidden_BTD, weight_VD, targets_BT, chunk_bytes=chunk_bytes)
    first = torch.autograd.grad(logprobs_BT.sum(), (hidden_BTD, weight_VD), retain_graph=True)
    second = torch.autograd.grad(logprobs_BT.sum(), (hidden_BTD, weight_VD))
    for a, b in zip(first, second, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
