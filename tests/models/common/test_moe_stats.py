"""Router statistics: the load-balancing loss equals transformers' on the same router logits
(padding masked), sums that add up over parts give the same numbers, per-layer load and
entropy at their known extremes, and routings kept per thread."""

from __future__ import annotations

import math
import sys
import threading

import pytest
import torch

from temper.models import materialize, qwen3_moe_size
from temper.models.common.moe import MoE, Routing, route
from temper.models.common.moe_stats import (
    RouterSums,
    load_balancing_loss,
    moe_layers,
    router_metrics,
    select_tokens,
)

E, K = 8, 2


def _router_logits(*, num_layers: int, num_rows: int, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(num_rows, E, generator=generator) * 2 for _ in range(num_layers)]


def _routing(logits_NE: torch.Tensor) -> Routing:
    probs_NE, _, experts_NK = route(logits_NE, top_k=K, norm_topk_prob=True)
    return Routing(probs_NE=probs_NE, experts_NK=experts_NK)


def test_load_balancing_loss_equals_transformers_with_padding_masked():
    transformers = pytest.importorskip("transformers.models.qwen3_moe.modeling_qwen3_moe")
    # Three rows of 7 positions, right-padded to lengths 7, 4 and 2; three sparse layers.
    mask_BT = torch.arange(7)[None, :] < torch.tensor([[7], [4], [2]])
    logits = [x.requires_grad_() for x in _router_logits(num_layers=3, num_rows=21)]
    expected = transformers.load_balancing_loss_func(
        tuple(logits), num_experts=E, top_k=K, attention_mask=mask_BT.long()
    )
    rows_N = mask_BT.reshape(-1).nonzero().squeeze(1)
    routings = [select_tokens(_routing(x), rows_N) for x in logits]
    actual = load_balancing_loss(routings, num_experts=E)
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=0)
    expected_grads = torch.autograd.grad(expected, logits)
    actual_grads = torch.autograd.grad(actual, logits)
    for got, wanted in zip(actual_grads, expected_grads, strict=True):
        torch.testing.assert_close(got, wanted, rtol=1e-5, atol=1e-8)
    # The detached sums give the same value, also when the tokens come in two parts.
    first, second = rows_N[:5], rows_N[5:]
    sums = RouterSums.of([select_tokens(_routing(x), first) for x in logits])
    sums = sums + RouterSums.of([select_tokens(_routing(x), second) for x in logits])
    assert sums.num_tokens == mask_BT.sum()
    assert sums.aux_loss == pytest.approx(expected.item(), rel=1e-6)


def test_load_and_entropy_at_their_extremes():
    num_rows = 16
    # Layer 0: a uniform router whose top-2 cycle over the experts (perfectly balanced).
    uniform = Routing(
        probs_NE=torch.full((num_rows, E), 1 / E),
        experts_NK=torch.arange(num_rows * K).view(num_rows, K) % E,
    )
    # Layer 1: one-hot on expert 3, which every token picks (with expert 5).
    one_hot_NE = torch.zeros(num_rows, E)
    one_hot_NE[:, 3] = 1.0
    collapsed = Routing(probs_NE=one_hot_NE, experts_NK=torch.tensor([[3, 5]]).expand(num_rows, K))
    sums = RouterSums.of([uniform, collapsed])
    metrics = sums.metrics(layers=[2, 10], num_layers=12)
    assert metrics["moe/layer_02/max_load"] == pytest.approx(1.0)
    assert metrics["moe/layer_02/entropy"] == pytest.approx(math.log(E))
    assert metrics["moe/layer_10/max_load"] == pytest.approx(E / K)
    assert metrics["moe/layer_10/entropy"] == 0.0
    assert metrics["moe/max_load"] == pytest.approx(E / K)
    assert metrics["moe/entropy"] == pytest.approx(math.log(E) / 2)
    assert list(metrics)[:3] == ["moe/aux_loss", "moe/max_load", "moe/entropy"]
    # Balanced alone: the loss is K; everything on one expert pair: E.
    assert RouterSums.of([uniform]).aux_loss == pytest.approx(K)
    assert RouterSums.of([collapsed]).aux_loss == pytest.approx(E)


def test_sums_survive_a_round_trip_through_one_vector():
    logits = _router_logits(num_layers=2, num_rows=9, seed=1)
    sums = RouterSums.of([_routing(x) for x in logits])
    again = sums.from_flat(sums.flat() * 2)
    assert again.num_tokens == 2 * sums.num_tokens
    assert torch.equal(again.assignments_LE, 2 * sums.assignments_LE)
    assert torch.equal(again.entropy_L, 2 * sums.entropy_L)
    assert again.aux_loss == pytest.approx(sums.aux_loss)
    zero = RouterSums.zeros(num_layers=2, num_experts=E, top_k=K)
    assert (zero + sums).metrics(layers=[0, 1], num_layers=2) == sums.metrics(
        layers=[0, 1], num_layers=2
    )


def test_router_metrics_are_the_moe_keys_without_their_reduction():
    metrics = {"loss:sum": 3.0, "moe/aux_loss:mean": 2.1, "moe/layer_1/entropy:mean": 1.5}
    assert router_metrics(metrics) == {"moe/aux_loss": 2.1, "moe/layer_1/entropy": 1.5}
    assert router_metrics({"loss:sum": 1.0}) == {}


def test_moe_layers_are_the_sparse_blocks_in_order():
    config = qwen3_moe_size("tiny", vocab_size=17)
    config.mlp_only_layers = (1,)
    model = materialize(config)
    assert [index for index, _ in moe_layers(model)] == [0, 2, 3]
    assert all(isinstance(block, MoE) for _, block in moe_layers(model))


@pytest.fixture
def switch_often():
    """Threads switch between almost any two bytecodes (races show up)."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(interval)


def test_routings_are_kept_per_thread(switch_often):
    torch.manual_seed(0)
    moe = MoE(dim=16, hidden_dim=8, num_experts=E, top_k=K, norm_topk_prob=True)
    moe.keep_routing = True
    inputs = {name: torch.randn(1, 50 + name, 16) for name in range(4)}
    kept: dict[int, Routing] = {}
    barrier = threading.Barrier(len(inputs))

    def run(name: int) -> None:
        barrier.wait()  # every thread's forwards interleave with the others'
        for _ in range(20):
            moe(inputs[name])
            kept[name] = moe.routing

    threads = [threading.Thread(target=run, args=(name,)) for name in inputs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for name, x in inputs.items():
        expected = _routing_of(moe, x)
        assert torch.equal(kept[name].experts_NK, expected.experts_NK), name
    assert moe.routing is None  # this thread ran no forward


def _routing_of(moe: MoE, x_BTD: torch.Tensor) -> Routing:
    with torch.no_grad():
        logits_NE = moe.router(x_BTD.reshape(-1, x_BTD.shape[-1]))
    probs_NE, _, experts_NK = route(logits_NE, top_k=K, norm_topk_prob=True)
    return Routing(probs_NE=probs_NE, experts_NK=experts_NK)
