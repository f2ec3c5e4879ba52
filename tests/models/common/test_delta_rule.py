"""The gated delta rule's two forms: the chunked form equals transformers' reference and the
token-by-token recurrence (values and gradients, any chunk length, from a given state), and
beta = g = 0 leaves the state unchanged."""

from __future__ import annotations

import pytest
import torch

from temper.models.common.delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_rule


def _inputs(*, T: int = 150, seed: int = 0) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    B, N, K, V = 2, 4, 16, 24
    q_BTNK = torch.randn(B, T, N, K, generator=generator)
    k_BTNK = torch.randn(B, T, N, K, generator=generator)
    v_BTNV = torch.randn(B, T, N, V, generator=generator)
    g_BTN = -torch.rand(B, T, N, generator=generator)
    beta_BTN = torch.rand(B, T, N, generator=generator)
    state_BNKV = 0.1 * torch.randn(B, N, K, V, generator=generator)
    return q_BTNK, k_BTNK, v_BTNV, g_BTN, beta_BTN, state_BNKV


def test_chunked_form_equals_the_transformers_reference():
    pytest.importorskip("transformers")
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    *tensors, state_BNKV = _inputs()
    expected, expected_state = torch_chunk_gated_delta_rule(
        *tensors[:3],
        g=tensors[3],
        beta=tensors[4],
        initial_state=state_BNKV,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    out, state = chunk_gated_delta_rule(*tensors, state_BNKV=state_BNKV)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(state, expected_state, rtol=0, atol=1e-6)


@pytest.mark.parametrize("chunk_size", [16, 64, 128])
def test_chunked_form_equals_the_recurrence_values_and_gradients(chunk_size):
    *tensors, state_BNKV = _inputs(T=100)
    leaves = [t.clone().requires_grad_() for t in tensors]
    out, state = chunk_gated_delta_rule(*leaves, state_BNKV=state_BNKV, chunk_size=chunk_size)
    (out.square().sum() + state.sum()).backward()
    chunk_grads = [leaf.grad for leaf in leaves]
    leaves = [t.clone().requires_grad_() for t in tensors]
    expected, expected_state = recurrent_gated_delta_rule(*leaves, state_BNKV=state_BNKV)
    (expected.square().sum() + expected_state.sum()).backward()
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(state, expected_state, rtol=0, atol=1e-5)
    for grad, leaf in zip(chunk_grads, leaves, strict=True):
        torch.testing.assert_close(grad, leaf.grad, rtol=1e-4, atol=1e-4)


def test_zero_beta_and_decay_positions_leave_the_state_unchanged():
    q_BTNK, k_BTNK, v_BTNV, g_BTN, beta_BTN, state_BNKV = _inputs(T=70)
    _, at_40 = chunk_gated_delta_rule(
        q_BTNK[:, :40],
        k_BTNK[:, :40],
        v_BTNV[:, :40],
        g_BTN[:, :40],
        beta_BTN[:, :40],
        state_BNKV=state_BNKV,
    )
    g_BTN[:, 40:], beta_BTN[:, 40:] = 0.0, 0.0
    _, padded = chunk_gated_delta_rule(
        q_BTNK, k_BTNK, v_BTNV, g_BTN, beta_BTN, state_BNKV=state_BNKV
    )
    torch.testing.assert_close(padded, at_40, rtol=0, atol=1e-6)
