"""LoRA on routed experts (models/lora_experts.py): forward and gradients of a MoE block with
expert adapters against a token-by-token reference on merged weights (W + scale * B @ A as a
differentiable function of A and B), and the grouped kernel against per-expert slices."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from temper.models.common.moe import MoE, route
from temper.models.lora_experts import (
    EXPERT_TARGETS,
    ExpertsLora,
    LoraGroupedExperts,
    grouped_low_rank,
)

RANK, ALPHA = 3, 6.0


def _lora_moe(
    seed: int = 0, *, rank: int = RANK, device: str = "cpu", dtype: torch.dtype = torch.float32
) -> MoE:
    """A MoE block with an adapter on each expert weight, B away from zero."""
    generator = torch.Generator().manual_seed(seed)
    moe = MoE(dim=32, hidden_dim=24, num_experts=6, top_k=2, norm_topk_prob=True)
    with torch.no_grad():
        for parameter in moe.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    moe.requires_grad_(False)
    moe.experts = LoraGroupedExperts(moe.experts)
    for name in EXPERT_TARGETS:
        weight_EOI = getattr(moe.experts, name)
        num_experts, _, in_features = weight_EOI.shape
        lora_A_ERI = torch.randn(num_experts, rank, in_features, generator=generator) * 0.2
        adapter = ExpertsLora(weight_EOI, lora_A_ERI=lora_A_ERI, alpha=ALPHA)
        with torch.no_grad():
            adapter.lora_B.copy_(torch.randn(adapter.lora_B.shape, generator=generator) * 0.2)
        setattr(moe.experts, f"{name}_adapter", adapter)
    return moe.to(device=device, dtype=dtype)


def _adapters(moe: MoE) -> list[torch.Tensor]:
    adapters = [getattr(moe.experts, f"{name}_adapter") for name in EXPERT_TARGETS]
    return [factor for adapter in adapters for factor in (adapter.lora_A, adapter.lora_B)]


def _reference(moe: MoE, x_ND: torch.Tensor) -> torch.Tensor:
    """The block token by token, each expert's weight merged with its adapter."""
    _, weights_NK, experts_NK = route(moe.router(x_ND), top_k=2, norm_topk_prob=True)
    experts = moe.experts

    def weight(name: str, e: int) -> torch.Tensor:
        adapter = getattr(experts, f"{name}_adapter")
        delta = adapter.lora_B[e] @ adapter.lora_A[e]
        return getattr(experts, name)[e] + adapter.scale * delta

    rows = []
    for n in range(x_ND.shape[0]):
        total = 0
        for k in range(2):
            e = int(experts_NK[n, k])
            hidden = F.silu(weight("w_gate", e) @ x_ND[n]) * (weight("w_up", e) @ x_ND[n])
            total = total + weights_NK[n, k] * (weight("w_down", e) @ hidden)
        rows.append(total)
    return torch.stack(rows)


def test_forward_and_gradients_equal_merged_weights_token_by_token():
    moe = _lora_moe()
    x_BTD = torch.randn(2, 9, 32, requires_grad=True)
    grad_BTD = torch.randn(2, 9, 32)
    inputs = [x_BTD, *_adapters(moe)]
    out_BTD = moe(x_BTD)
    grads = torch.autograd.grad(out_BTD, inputs, grad_BTD)
    expected_BTD = _reference(moe, x_BTD.reshape(-1, 32)).view(2, 9, 32)
    expected = torch.autograd.grad(expected_BTD, inputs, grad_BTD)
    torch.testing.assert_close(out_BTD, expected_BTD, rtol=1e-5, atol=1e-5)
    for actual, wanted in zip(grads, expected, strict=True):
        torch.testing.assert_close(actual, wanted, rtol=1e-4, atol=1e-5)
    assert all(g.abs().sum() > 0 for g in grads)
    assert not any(p.requires_grad for p in (moe.router.weight, moe.experts.w_gate))


def test_merged_delta_is_each_experts_scaled_product():
    moe = _lora_moe(1)
    adapter = moe.experts.w_down_adapter
    delta_EOI = adapter.delta_weight()
    assert delta_EOI.shape == moe.experts.w_down.shape
    expected = ALPHA / RANK * adapter.lora_B[4] @ adapter.lora_A[4]
    torch.testing.assert_close(delta_EOI[4], expected, rtol=0, atol=1e-7)


def test_router_weights_given_to_the_experts_scale_each_rows_output():
    experts = _lora_moe(2).experts
    counts_E = [4, 0, 2, 6, 1, 3]
    generator = torch.Generator().manual_seed(3)
    x_AD = torch.randn(sum(counts_E), 32, generator=generator)
    weights_A = torch.rand(sum(counts_E), generator=generator)
    with torch.no_grad():
        scaled_AD = experts(x_AD, counts_E=counts_E, offsets_E=None, weights_A=weights_A)
        plain_AD = experts(x_AD, counts_E=counts_E, offsets_E=None)
    torch.testing.assert_close(scaled_AD, plain_AD * weights_A[:, None], rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("rank", [8, 4], ids=["grouped-kernel", "slices-for-odd-rank"])
def test_cuda_grouped_low_rank_equals_per_expert_slices(rank):
    generator = torch.Generator().manual_seed(0)
    counts_E = [5, 0, 3, 17, 1, 0]
    x_AI = torch.randn(sum(counts_E), 64, generator=generator).cuda().bfloat16()
    lora_A_ERI = (torch.randn(6, rank, 64, generator=generator) * 0.2).cuda()  # fp32 adapters
    lora_B_EOR = (torch.randn(6, 32, rank, generator=generator) * 0.2).cuda()
    offsets_E = torch.tensor(counts_E).cumsum(0).to(device="cuda", dtype=torch.int32)
    grouped = grouped_low_rank(x_AI, lora_A_ERI, lora_B_EOR, counts_E=None, offsets_E=offsets_E)
    sliced = grouped_low_rank(x_AI, lora_A_ERI, lora_B_EOR, counts_E=counts_E, offsets_E=None)
    assert grouped.dtype == torch.bfloat16
    torch.testing.assert_close(grouped.float(), sliced.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_bf16_lora_block_trains_through_the_grouped_kernel():
    moe = _lora_moe(rank=8, device="cuda", dtype=torch.bfloat16)
    x_BTD = torch.randn(2, 40, 32, device="cuda", dtype=torch.bfloat16)
    out_BTD = moe(x_BTD)
    out_BTD.float().square().sum().backward()
    reference = copy.deepcopy(moe).float()
    with torch.no_grad():
        expected_BTD = _reference(reference, x_BTD.float().reshape(-1, 32)).view(2, 40, 32)
    error = (out_BTD.float() - expected_BTD).norm() / expected_BTD.norm()
    assert error < 2e-2  # bf16 rounding
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in _adapters(moe))
