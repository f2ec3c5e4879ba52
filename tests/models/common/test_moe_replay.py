"""Routing replay and route records in the MoE block: replayed experts weighted by the router's
probabilities at them (renormalized or not) against a token-by-token reference, forward and
gradients (the router's too); replaying the router's own choice is bitwise the plain block;
tokens not given keep the router's choice; replays and tapes are per thread, and a backward's
recomputation on a thread without one (CUDA's autograd thread) replays the one set."""

from __future__ import annotations

import threading

import pytest
import torch

from temper.models.common.moe import MoE, ReplayedRoutes, route


def _moe(seed: int = 0, *, norm_topk_prob: bool = True) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(dim=32, hidden_dim=24, num_experts=6, top_k=2, norm_topk_prob=norm_topk_prob)
    with torch.no_grad():
        for parameter in moe.parameters():
            parameter.normal_(0.0, 0.3)
    return moe


def _reference(moe: MoE, x_ND: torch.Tensor, experts_NK: torch.Tensor) -> torch.Tensor:
    """The block with given experts, token by token: each expert's output weighted by its
    router probability (divided by the given experts' total with norm_topk_prob)."""
    probs_NE = torch.softmax(moe.router(x_ND).float(), dim=-1)
    experts = moe.experts
    rows = []
    for n in range(x_ND.shape[0]):
        chosen = probs_NE[n, experts_NK[n]]
        weights = chosen / chosen.sum() if moe.norm_topk_prob else chosen
        total = 0
        for k in range(experts_NK.shape[1]):
            e = experts_NK[n, k]
            hidden = torch.nn.functional.silu(experts.w_gate[e] @ x_ND[n]) * (
                experts.w_up[e] @ x_ND[n]
            )
            total = total + weights[k] * (experts.w_down[e] @ hidden)
        rows.append(total)
    return torch.stack(rows)


def _other_experts(experts_NK: torch.Tensor, *, num_experts: int, seed: int) -> torch.Tensor:
    """Distinct experts per token, none of them the router's choice where possible."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for chosen in experts_NK.tolist():
        others = [e for e in range(num_experts) if e not in chosen]
        order = torch.randperm(len(others), generator=generator)[: len(chosen)]
        rows.append([others[i] for i in order])
    return torch.tensor(rows)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_replayed_experts_equal_a_token_by_token_reference(norm_topk_prob):
    moe = _moe(norm_topk_prob=norm_topk_prob)
    x_BTD = torch.randn(2, 7, 32, requires_grad=True)
    grad_BTD = torch.randn(2, 7, 32)
    x_ND = x_BTD.reshape(-1, 32)
    with torch.no_grad():
        _, _, own_NK = route(moe.router(x_ND), top_k=2, norm_topk_prob=norm_topk_prob)
    given_NK = _other_experts(own_NK, num_experts=6, seed=1)
    thread = threading.get_ident()
    moe.replays[thread] = ReplayedRoutes(
        experts_NK=given_NK, given_N1=torch.ones(14, 1, dtype=torch.bool)
    )
    moe.keep_routing = True
    try:
        out_BTD = moe(x_BTD)
    finally:
        moe.replays.clear()
    assert torch.equal(moe.routing.experts_NK, given_NK)  # what the block used is recorded
    parameters = [x_BTD, *moe.parameters()]
    grads = torch.autograd.grad(out_BTD, parameters, grad_BTD)
    expected_BTD = _reference(moe, x_ND, given_NK).view(2, 7, 32)
    expected = torch.autograd.grad(expected_BTD, parameters, grad_BTD)
    torch.testing.assert_close(out_BTD, expected_BTD, rtol=1e-5, atol=1e-5)
    for actual, wanted in zip(grads, expected, strict=True):
        torch.testing.assert_close(actual, wanted, rtol=1e-4, atol=1e-5)
    router_grad = grads[1]
    assert router_grad.abs().sum() > 0  # the router learns through the replayed weights


def test_replaying_the_routers_own_choice_is_bitwise_the_plain_block():
    moe = _moe(3)
    x_BTD = torch.randn(3, 5, 32, requires_grad=True)
    grad_BTD = torch.randn(3, 5, 32)
    plain = moe(x_BTD)
    plain_grads = torch.autograd.grad(plain, [x_BTD, *moe.parameters()], grad_BTD)
    with torch.no_grad():
        _, _, own_NK = route(moe.router(x_BTD.reshape(-1, 32)), top_k=2, norm_topk_prob=True)
    moe.replays[threading.get_ident()] = ReplayedRoutes(
        experts_NK=own_NK, given_N1=torch.ones(15, 1, dtype=torch.bool)
    )
    replayed = moe(x_BTD)
    moe.replays.clear()
    replayed_grads = torch.autograd.grad(replayed, [x_BTD, *moe.parameters()], grad_BTD)
    assert torch.equal(plain, replayed)
    for a, b in zip(plain_grads, replayed_grads, strict=True):
        assert torch.equal(a, b)


def test_tokens_not_given_keep_the_routers_choice():
    moe = _moe(4)
    x_ND = torch.randn(6, 32)
    with torch.no_grad():
        _, _, own_NK = route(moe.router(x_ND), top_k=2, norm_topk_prob=True)
    given_NK = _other_experts(own_NK, num_experts=6, seed=2)
    given_N1 = torch.tensor([True, False, True, False, False, True])[:, None]
    moe.replays[threading.get_ident()] = ReplayedRoutes(experts_NK=given_NK, given_N1=given_N1)
    moe.keep_routing = True
    with torch.no_grad():
        out_ND = moe(x_ND[None])[0]
    moe.replays.clear()
    used_NK = moe.routing.experts_NK
    assert torch.equal(used_NK, torch.where(given_N1, given_NK, own_NK))
    torch.testing.assert_close(out_ND, _reference(moe, x_ND, used_NK), rtol=1e-5, atol=1e-5)


def test_replays_and_tapes_are_per_thread():
    moe = _moe(5)
    x_ND = torch.randn(4, 32)
    with torch.no_grad():
        _, _, own_NK = route(moe.router(x_ND), top_k=2, norm_topk_prob=True)
    given_NK = _other_experts(own_NK, num_experts=6, seed=3)
    tape: list[torch.Tensor] = []
    moe.tapes[threading.get_ident()] = tape
    other_thread: dict[str, list[torch.Tensor]] = {}

    def run_elsewhere() -> None:
        mine: list[torch.Tensor] = []
        moe.tapes[threading.get_ident()] = mine
        moe.replays[threading.get_ident()] = ReplayedRoutes(
            experts_NK=given_NK, given_N1=torch.ones(4, 1, dtype=torch.bool)
        )
        with torch.no_grad():
            moe(x_ND[None])
        moe.replays.pop(threading.get_ident())
        moe.tapes.pop(threading.get_ident())
        other_thread["tape"] = mine

    worker = threading.Thread(target=run_elsewhere)
    worker.start()
    worker.join()
    with torch.no_grad():
        moe(x_ND[None])  # this thread has no replay: the router's own choice
    moe.tapes.clear()
    assert len(tape) == 1 and torch.equal(tape[0], own_NK)
    assert len(other_thread["tape"]) == 1 and torch.equal(other_thread["tape"][0], given_NK)


def test_a_recomputation_on_another_thread_replays_the_one_replay_set():
    """Activation checkpointing recomputes a block's forward in backward, on autograd's
    device thread on CUDA: with gradients on and exactly one replay set, a thread without
    its own replays that one; without gradients (a sampler's decode) it does not."""
    moe = _moe(6)
    x_ND = torch.randn(5, 32)
    with torch.no_grad():
        _, _, own_NK = route(moe.router(x_ND), top_k=2, norm_topk_prob=True)
    given_NK = _other_experts(own_NK, num_experts=6, seed=4)
    moe.replays[threading.get_ident()] = ReplayedRoutes(
        experts_NK=given_NK, given_N1=torch.ones(5, 1, dtype=torch.bool)
    )
    seen: dict[str, torch.Tensor] = {}

    def forward_elsewhere(name: str, *, grad: bool) -> None:
        tape: list[torch.Tensor] = []
        moe.tapes[threading.get_ident()] = tape
        with torch.set_grad_enabled(grad):
            moe(x_ND[None])
        moe.tapes.pop(threading.get_ident())
        seen[name] = tape[0]

    for name, grad in (("recomputation", True), ("decode", False)):
        worker = threading.Thread(target=forward_elsewhere, args=(name,), kwargs={"grad": grad})
        worker.start()
        worker.join()
    moe.replays.clear()
    assert torch.equal(seen["recomputation"], given_NK)
    assert torch.equal(seen["decode"], own_NK)
