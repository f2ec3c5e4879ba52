"""The MoE block: its hand-written backward against autograd of the reference path (router
weights folded in or not, frozen experts), the grouped-kernel path and expert threads against
the sliced path on the calling thread, router top-k with and without renormalizing, a token's
output independent of its batch, and config validation."""

from __future__ import annotations

import pytest
import torch

from temper.distributed.thread_shards import ThreadShards
from temper.models.common import moe as moe_module
from temper.models.common.moe import GroupedExperts, MoE, route, use_expert_threads
from temper.models.common.sliced_experts import MIN_GROUP_ROWS, expert_groups
from temper.models.qwen3_moe import Qwen3Moe, qwen3_moe_size


def _moe(seed: int = 0, *, norm_topk_prob: bool = True, top_k: int = 2) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(dim=32, hidden_dim=24, num_experts=6, top_k=top_k, norm_topk_prob=norm_topk_prob)
    with torch.no_grad():
        for parameter in moe.parameters():
            parameter.normal_(0.0, 0.3)
    return moe


def _reference(moe: MoE, x_ND: torch.Tensor) -> torch.Tensor:
    """The block computed token by token with plain autograd ops."""
    _, weights_NK, experts_NK = route(
        moe.router(x_ND), top_k=moe.top_k, norm_topk_prob=moe.norm_topk_prob
    )
    experts = moe.experts
    rows = []
    for n in range(x_ND.shape[0]):
        total = 0
        for k in range(moe.top_k):
            e = experts_NK[n, k]
            hidden = torch.nn.functional.silu(experts.w_gate[e] @ x_ND[n]) * (
                experts.w_up[e] @ x_ND[n]
            )
            total = total + weights_NK[n, k] * (experts.w_down[e] @ hidden)
        rows.append(total)
    return torch.stack(rows)


@pytest.mark.parametrize(("norm_topk_prob", "top_k"), [(True, 2), (False, 2), (True, 1), (True, 6)])
def test_forward_and_gradients_equal_a_token_by_token_reference(norm_topk_prob, top_k):
    moe = _moe(norm_topk_prob=norm_topk_prob, top_k=top_k)
    x_BTD = torch.randn(2, 9, 32, requires_grad=True)
    grad_BTD = torch.randn(2, 9, 32)
    out_BTD = moe(x_BTD)
    grads = torch.autograd.grad(out_BTD, [x_BTD, *moe.parameters()], grad_BTD)
    expected_BTD = _reference(moe, x_BTD.reshape(-1, 32)).view(2, 9, 32)
    expected = torch.autograd.grad(expected_BTD, [x_BTD, *moe.parameters()], grad_BTD)
    torch.testing.assert_close(out_BTD, expected_BTD, rtol=1e-5, atol=1e-5)
    for actual, wanted in zip(grads, expected, strict=True):
        torch.testing.assert_close(actual, wanted, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("weighted", [True, False])
def test_sliced_backward_equals_autograd_of_the_grouped_reference(weighted):
    moe = _moe(1)
    experts = moe.experts
    counts_E = [5, 0, 3, 7, 1, 0]
    x_AD = torch.randn(sum(counts_E), 32, requires_grad=True)
    # Router weights scale each row's output (folded in before the down projection).
    weights_A = torch.rand(sum(counts_E), requires_grad=True) if weighted else None
    grad_AD = torch.randn(sum(counts_E), 32)
    inputs = [x_AD, experts.w_gate, experts.w_up, experts.w_down]
    inputs += [weights_A] if weighted else []
    groups = {"counts_E": counts_E, "offsets_E": None, "weights_A": weights_A}
    sliced = experts(x_AD, **groups)
    reference = experts.reference(x_AD, **groups)
    torch.testing.assert_close(sliced, reference, rtol=1e-5, atol=1e-5)
    sliced_grads = torch.autograd.grad(sliced, inputs, grad_AD)
    for actual, wanted in zip(
        sliced_grads, torch.autograd.grad(reference, inputs, grad_AD), strict=True
    ):
        torch.testing.assert_close(actual, wanted, rtol=1e-5, atol=1e-5)
    # Experts without rows get zero gradients.
    assert sliced_grads[2][1].abs().sum() == 0 and sliced_grads[3][5].abs().sum() == 0


def test_frozen_experts_still_pass_gradients_to_the_input_and_router():
    # A LoRA user's base: the experts' weights need no gradient, the tokens and router do.
    moe = _moe(5)
    x_BTD = torch.randn(2, 7, 32, requires_grad=True)
    grad_BTD = torch.randn(2, 7, 32)
    expected = torch.autograd.grad(moe(x_BTD), [x_BTD, moe.router.weight], grad_BTD)
    moe.experts.requires_grad_(False)
    actual = torch.autograd.grad(moe(x_BTD), [x_BTD, moe.router.weight], grad_BTD)
    for got, wanted in zip(actual, expected, strict=True):
        torch.testing.assert_close(got, wanted, rtol=0, atol=0)


def test_backward_accumulates_into_grad_what_autograd_grad_returns():
    moe = _moe(6)
    x_BTD = torch.randn(1, 11, 32)
    grad_BTD = torch.randn(1, 11, 32)
    expected = torch.autograd.grad(moe(x_BTD), list(moe.parameters()), grad_BTD)
    moe(x_BTD).backward(grad_BTD)
    for parameter, wanted in zip(moe.parameters(), expected, strict=True):
        torch.testing.assert_close(parameter.grad, wanted, rtol=0, atol=0)


def test_grouped_kernel_path_equals_the_sliced_path(monkeypatch):
    # F.grouped_mm runs on CPU too (slowly); the CUDA bf16 path uses it as the kernel. The
    # whole block, gradients included, on either path.
    moe = _moe(2)
    x_BTD = torch.randn(2, 9, 32, requires_grad=True)
    grad_BTD = torch.randn(2, 9, 32)
    inputs = [x_BTD, *moe.parameters()]
    sliced = moe(x_BTD)
    sliced_grads = torch.autograd.grad(sliced, inputs, grad_BTD)
    monkeypatch.setattr(moe_module, "use_grouped_mm", lambda x: True)
    grouped = moe(x_BTD)
    torch.testing.assert_close(grouped, sliced, rtol=1e-5, atol=1e-6)
    for actual, wanted in zip(
        torch.autograd.grad(grouped, inputs, grad_BTD), sliced_grads, strict=True
    ):
        torch.testing.assert_close(actual, wanted, rtol=1e-5, atol=1e-5)


def test_router_renormalizes_the_top_k_only_when_asked():
    logits_NE = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    probs_NE, weights_NK, experts_NK = route(logits_NE, top_k=2, norm_topk_prob=False)
    assert experts_NK.tolist() == [[0, 1]]
    torch.testing.assert_close(weights_NK, probs_NE[:, :2])
    _, renormalized_NK, _ = route(logits_NE, top_k=2, norm_topk_prob=True)
    torch.testing.assert_close(renormalized_NK.sum(-1), torch.ones(1))


def test_a_tokens_output_does_not_depend_on_which_tokens_share_its_batch():
    # Up to the matmul kernels' own blocking by row count (as in any linear layer).
    moe = _moe(3)
    x_ND = torch.randn(16, 32)
    with torch.no_grad():
        together = moe(x_ND.unsqueeze(0))[0]
        alone = torch.cat([moe(x_ND[n : n + 1].unsqueeze(0))[0] for n in range(16)])
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-5)


def test_keep_routing_records_the_router_choices():
    moe = _moe(4)
    x_BTD = torch.randn(1, 5, 32)
    moe(x_BTD)
    assert moe.routing is None
    moe.keep_routing = True
    moe(x_BTD)
    assert moe.routing.probs_NE.shape == (5, 6) and moe.routing.experts_NK.shape == (5, 2)
    torch.testing.assert_close(moe.routing.probs_NE.sum(-1), torch.ones(5))


def test_top_k_above_the_expert_count_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"Qwen3Moe\.Config\.top_k=9 exceeds num_experts=8"):
        qwen3_moe_size("tiny", vocab_size=17).__class__(
            vocab_size=17,
            dim=8,
            num_layers=1,
            num_heads=2,
            num_kv_heads=1,
            head_dim=4,
            ffn_dim=8,
            num_experts=8,
            top_k=9,
            moe_ffn_dim=4,
        )
    assert Qwen3Moe.Config  # the family the message names


def test_expert_threads_give_the_calling_threads_results():
    # Enough rows for two groups (MIN_GROUP_ROWS each), experts of uneven sizes.
    moe = _moe(7)
    x_BTD = torch.randn(2, 200, 32, requires_grad=True)
    grad_BTD = torch.randn(2, 200, 32)
    inputs = [x_BTD, *moe.parameters()]
    out_BTD = moe(x_BTD)
    expected = torch.autograd.grad(out_BTD, inputs, grad_BTD)
    threads = ThreadShards(2)
    try:
        use_expert_threads(moe, threads)
        runs = []
        for _ in range(2):
            threaded_BTD = moe(x_BTD)
            runs.append([threaded_BTD, *torch.autograd.grad(threaded_BTD, inputs, grad_BTD)])
    finally:
        use_expert_threads(moe, None)
        threads.close()
    torch.testing.assert_close(runs[0][0], out_BTD, rtol=1e-5, atol=1e-6)
    for actual, wanted in zip(runs[0][1:], expected, strict=True):
        torch.testing.assert_close(actual, wanted, rtol=1e-5, atol=1e-5)
    # Each group's work is fixed by the routing: the same bits every run.
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))
    assert moe.experts.threads is None


def test_expert_groups_split_consecutive_experts_by_rows():
    counts_E = [300, 0, 100, 500, 0, 200, 100]
    groups = expert_groups(counts_E, num_groups=3)
    assert [group.experts for group in groups] == [[0, 2], [3], [5, 6]]
    assert [group.rows for group in groups] == [slice(0, 400), slice(400, 900), slice(900, 1200)]
    assert [group.counts for group in groups] == [[300, 100], [500], [200, 100]]
    # No group below MIN_GROUP_ROWS: small batches (decode) stay in one group.
    assert len(expert_groups([MIN_GROUP_ROWS, 10, 0], num_groups=4)) == 1
    assert expert_groups([0, 0], num_groups=2) == []


def test_use_expert_threads_reaches_every_moe_block():
    model = Qwen3Moe(qwen3_moe_size("tiny", vocab_size=17))
    threads = ThreadShards(2)
    try:
        use_expert_threads(model, threads)
        blocks = [m for m in model.modules() if isinstance(m, GroupedExperts)]
        assert blocks and all(block.threads is threads for block in blocks)
    finally:
        use_expert_threads(model, None)
        threads.close()
    assert all(block.threads is None for block in blocks)


def test_under_autocast_the_experts_compute_in_autocasts_dtype():
    # bf16-mixed: fp32 masters, bf16 matmuls; the experts' own kernels are not on autocast's
    # lists, so the block casts their rows and weights as autocast casts a linear's.
    moe = _moe(5)
    x_BTD = torch.randn(2, 7, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_BTD = moe(x_BTD)
    assert out_BTD.dtype == torch.bfloat16
    out_BTD.float().sum().backward()
    assert moe.experts.w_gate.grad.dtype == torch.float32
    bf16 = _moe(5).to(torch.bfloat16)
    with torch.no_grad():
        expected_BTD = bf16(x_BTD.detach().to(torch.bfloat16))
    torch.testing.assert_close(out_BTD.detach(), expected_BTD, rtol=0.05, atol=0.05)
