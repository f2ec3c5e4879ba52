"""Under a mixed-precision trainer's bf16 autocast over fp32 weights, a Gated DeltaNet layer
computes what a bf16 copy of its weights computes without autocast, bitwise: the conv, the
decay parameters and the gated norm at the projections' dtype, the delta rule in fp32 with
autocast off (the generator samples from the bf16 copy; docs/benchmarks.md,
`hybrid_mismatch_sources.py`)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from temper.models import materialize
from temper.models.common.delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_rule
from temper.models.qwen3_5 import qwen3_5_size


@pytest.fixture(scope="module")
def layers():
    """(fp32 layer with bf16-representable weights, its bf16 copy)."""
    config = dataclasses.replace(qwen3_5_size("tiny", vocab_size=37), init_std=0.1)
    layer = materialize(config, seed=2).blocks[0].linear_attention
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.copy_(parameter.to(torch.bfloat16).float())
    return layer, copy.deepcopy(layer).to(torch.bfloat16)


def test_gated_deltanet_under_autocast_is_its_bf16_copy(layers):
    layer_fp32, layer_bf16 = layers
    x_BTD = torch.randn(
        3, 40, layer_fp32.out_proj.out_features, generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        expected_BTD = layer_bf16(x_BTD.to(torch.bfloat16))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            mixed_BTD = layer_fp32(x_BTD)
    assert mixed_BTD.dtype == torch.bfloat16
    assert torch.equal(mixed_BTD, expected_BTD)


@pytest.mark.parametrize("rule", [chunk_gated_delta_rule, recurrent_gated_delta_rule])
def test_delta_rule_ignores_autocast(rule):
    g = torch.Generator().manual_seed(1)
    B, T, N, K, V = 2, 20, 4, 8, 8
    q, k = (torch.randn(B, T, N, K, generator=g) for _ in range(2))
    v = torch.randn(B, T, N, V, generator=g)
    decay = -torch.rand(B, T, N, generator=g)
    beta = torch.rand(B, T, N, generator=g)
    plain = rule(q, k, v, decay, beta, state_BNKV=None)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = rule(q, k, v, decay, beta, state_BNKV=None)
    for a, b in zip(plain, mixed, strict=True):
        assert a.dtype == b.dtype == torch.float32
        assert torch.equal(a, b)


def test_a_mixed_precision_backward_runs_and_gives_fp32_gradients(layers):
    layer_fp32, _ = layers
    layer = copy.deepcopy(layer_fp32)
    x_BTD = torch.randn(2, 40, layer.out_proj.out_features, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = layer(x_BTD).float().square().mean()
    loss.backward()
    for name, parameter in [("x", x_BTD), *layer.named_parameters()]:
        assert parameter.grad.dtype == torch.float32, name
        assert parameter.grad.isfinite().all() and parameter.grad.abs().sum() > 0, name
