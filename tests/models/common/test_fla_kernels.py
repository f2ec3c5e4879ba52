"""The Gated DeltaNet's GPU speed wing (fla_kernels.py): which kernels a build picks, the
arguments the layer hands fla and causal-conv1d (checked on CPU against stand-ins that follow
those packages' conventions), and on a GPU with fla installed, fla's layer against the pure
path."""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from temper.models.common import fla_kernels
from temper.models.common.delta_rule import recurrent_gated_delta_rule
from temper.models.common.fla_kernels import FlaKernels, load_fla_kernels
from temper.models.common.gated_deltanet import GatedDeltaNet
from temper.models.qwen3_5 import qwen3_5_size

SHAPE = {
    "dim": 32,
    "num_key_heads": 2,
    "num_value_heads": 4,
    "key_head_dim": 8,
    "value_head_dim": 6,
    "conv_kernel": 4,
}


def _stand_in_rule(calls):
    """fla's chunk_gated_delta_rule contract, computed by the pure recurrence."""

    def rule(q, k, v, g, beta, *, scale, initial_state, output_final_state, **flags):
        calls.append("rule")
        assert q.shape == k.shape == (*v.shape[:3], q.shape[-1])  # heads repeated to v's
        assert g.dtype == torch.float32 and beta.dtype == v.dtype
        assert scale == q.shape[-1] ** -0.5 and output_final_state
        assert flags == {"use_qk_l2norm_in_kernel": True}
        return recurrent_gated_delta_rule(q, k, v, g, beta, state_BNKV=initial_state)

    return rule


def _stand_in_conv(calls):
    """causal_conv1d_fn's contract: x [B, C, T], weight [C, J], bias, activation."""

    def conv(x_BCT, weight_CJ, bias, activation):
        calls.append("conv")
        assert x_BCT.shape[1] == weight_CJ.shape[0] and bias is None and activation == "silu"
        assert x_BCT.stride(1) == 1  # channels last: a transposed [B, T, C]
        J = weight_CJ.shape[1]
        out_BCX = F.conv1d(x_BCT, weight_CJ[:, None], padding=J - 1, groups=x_BCT.shape[1])
        return F.silu(out_BCX[..., : x_BCT.shape[-1]])

    return conv


@pytest.fixture
def installed(monkeypatch):
    """fla and causal_conv1d as importable stand-ins; the calls they get."""
    calls = []
    rule_module = types.ModuleType("fla.ops.gated_delta_rule")
    rule_module.chunk_gated_delta_rule = _stand_in_rule(calls)
    conv_module = types.ModuleType("causal_conv1d")
    conv_module.causal_conv1d_fn = _stand_in_conv(calls)
    for name in ("fla", "fla.ops"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", rule_module)
    monkeypatch.setitem(sys.modules, "causal_conv1d", conv_module)
    return calls


def test_a_build_picks_fla_when_importable_unless_turned_off(installed, monkeypatch):
    kernels = load_fla_kernels("auto")
    assert (
        kernels.chunk_gated_delta_rule
        is sys.modules["fla.ops.gated_delta_rule"].chunk_gated_delta_rule
    )
    assert kernels.causal_conv1d_fn is sys.modules["causal_conv1d"].causal_conv1d_fn
    assert load_fla_kernels("torch") is None
    monkeypatch.setitem(sys.modules, "causal_conv1d", None)  # absent: fla's rule, our conv
    assert load_fla_kernels("auto").causal_conv1d_fn is None
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", None)
    assert load_fla_kernels("auto") is None
    with pytest.raises(ValueError, match="linear_attention_kernels"):
        load_fla_kernels("triton")
    config = qwen3_5_size("tiny", vocab_size=32)
    with pytest.raises(ValueError, match="linear_attention_kernels"):
        dataclasses.replace(config, linear_attention_kernels="fla")
    assert not FlaKernels.applies(torch.zeros(1, dtype=torch.bfloat16))  # CPU: pure path


def test_the_layer_hands_fla_its_conventions_and_equals_the_pure_path(installed, monkeypatch):
    torch.manual_seed(0)
    pure = GatedDeltaNet(layer_index=0, norm_eps=1e-6, **SHAPE)
    for param in pure.parameters():
        torch.nn.init.normal_(param, std=0.2)
    wing = GatedDeltaNet(layer_index=0, norm_eps=1e-6, kernels=load_fla_kernels("auto"), **SHAPE)
    wing.load_state_dict(pure.state_dict())
    monkeypatch.setattr(fla_kernels.FlaKernels, "applies", staticmethod(lambda x: True))
    x_BTD = torch.randn(2, 37, SHAPE["dim"])
    torch.testing.assert_close(wing(x_BTD), pure(x_BTD), rtol=0, atol=1e-5)
    assert installed == ["conv", "rule"]


@pytest.mark.gpu
def test_fla_layer_equals_the_pure_path_on_cuda():
    pytest.importorskip("fla", reason="flash-linear-attention is not installed")
    kernels = load_fla_kernels("auto")
    torch.manual_seed(0)
    pure = GatedDeltaNet(layer_index=0, norm_eps=1e-6, **{**SHAPE, "key_head_dim": 64})
    for param in pure.parameters():
        torch.nn.init.normal_(param, std=0.05)
    wing = GatedDeltaNet(
        layer_index=0, norm_eps=1e-6, kernels=kernels, **{**SHAPE, "key_head_dim": 64}
    )
    wing.load_state_dict(pure.state_dict())
    pure, wing = (m.to(device="cuda", dtype=torch.bfloat16) for m in (pure, wing))
    x_BTD = torch.randn(2, 300, SHAPE["dim"], device="cuda", dtype=torch.bfloat16)
    outs, grads = [], []
    for layer in (wing, pure):
        x = x_BTD.clone().requires_grad_()
        out = layer(x)
        out.float().square().sum().backward()
        outs.append(out.float())
        grads.append(x.grad.float())
    scale = outs[1].abs().max()
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=2e-2 * scale.item())
    grad_scale = grads[1].abs().max()
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=5e-2 * grad_scale.item())
