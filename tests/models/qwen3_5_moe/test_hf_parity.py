"""Qwen3.5-MoE against transformers: fp32 logits, per-expert export that transformers reloads,
prefill + recurrent decode against the full forward, a training step reaching router, experts
and the shared expert, and the published sizes' parameter counts."""

from __future__ import annotations

import json

import pytest
import torch

from temper.checkpoint.hf import load_pretrained, save_pretrained
from temper.models.common.logprobs import forward_logprobs
from temper.models.common.shared_expert_moe import SharedExpertMoE
from temper.models.qwen3_5_moe import Qwen3_5Moe, qwen3_5_moe_size
from tests.models.hf_reference import (
    assert_export_reloads_exactly,
    save_hf,
    tiny_hf_qwen3_5_moe,
)
from tests.models.qwen3_5.reference_states import DictStates, right_padded

pytest.importorskip("transformers")


def _tokens(batch: int, length: int, *, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 97, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def hf_and_ours(tmp_path_factory):
    hf_model = tiny_hf_qwen3_5_moe()
    model = load_pretrained(save_hf(hf_model, tmp_path_factory.mktemp("hf")), dtype=torch.float32)
    return hf_model, model.eval()


def test_loaded_hf_checkpoint_matches_hf_logits(hf_and_ours):
    hf_model, model = hf_and_ours
    assert isinstance(model, Qwen3_5Moe)
    assert all(isinstance(block.feed_forward, SharedExpertMoE) for block in model.blocks)
    tokens_BT = _tokens(3, 90)
    with torch.no_grad():
        torch.testing.assert_close(
            model(tokens_BT), hf_model(input_ids=tokens_BT).logits, rtol=0, atol=1e-5
        )


def test_export_writes_one_tensor_per_expert_and_transformers_reloads_it(hf_and_ours, tmp_path):
    from safetensors import safe_open
    from transformers import Qwen3_5MoeForCausalLM

    hf_model, model = hf_and_ours
    save_pretrained(model, tmp_path / "export")
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5MoeForCausalLM"]
    assert config["shared_expert_intermediate_size"] == 48
    with safe_open(str(tmp_path / "export" / "model.safetensors"), "pt") as handle:
        keys = set(handle.keys())
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in keys
    assert "model.layers.3.mlp.shared_expert.up_proj.weight" in keys
    assert "model.layers.3.mlp.shared_expert_gate.weight" in keys
    assert "model.layers.1.linear_attn.conv1d.weight" in keys
    assert_export_reloads_exactly(
        hf_model,
        model,
        tmp_path / "export",
        tokens_BT=_tokens(2, 50, seed=1),
        hf_class=Qwen3_5MoeForCausalLM,
    )


@torch.no_grad()
def test_prefill_then_recurrent_decode_matches_the_full_forward(hf_and_ours):
    _, model = hf_and_ours
    prompts = [list(range(1, 70)), [4, 5, 6]]
    continuations = _tokens(2, 8, seed=2)
    states = DictStates()
    tokens_BT, lengths_B = right_padded(prompts)
    states.lengths_B = lengths_B
    logits_BTV = model.logits(model.hidden_states(tokens_BT, attention=states))
    steps = [logits_BTV[torch.arange(2), lengths_B - 1]]
    states.lengths_B = None
    for i in range(continuations.shape[1]):
        positions_B1 = (lengths_B + i)[:, None]
        hidden = model.hidden_states(
            continuations[:, i : i + 1], positions_BT=positions_B1, attention=states
        )
        steps.append(model.logits(hidden)[:, 0])
    for b, prompt in enumerate(prompts):
        full_TV = model(torch.tensor([prompt + continuations[b].tolist()]))[0]
        actual_SV = torch.stack([step[b] for step in steps])
        torch.testing.assert_close(actual_SV, full_TV[len(prompt) - 1 :], rtol=0, atol=1e-4)


def test_training_step_reaches_router_experts_and_shared_expert(tmp_path):
    model = load_pretrained(save_hf(tiny_hf_qwen3_5_moe(seed=1), tmp_path))
    tokens_BT = _tokens(2, 24, seed=5)
    loss = -forward_logprobs(model, tokens_BT[:, :-1], tokens_BT[:, 1:]).mean()
    loss.backward()
    moe = model.blocks[0].feed_forward
    for grad in (
        moe.router.weight.grad,
        moe.experts.w_down.grad,
        moe.shared_expert.w_up.weight.grad,
        moe.shared_expert_gate.weight.grad,
        model.blocks[0].linear_attention.A_log.grad,
        model.blocks[0].linear_attention.conv_weight.grad,
    ):
        assert grad is not None and grad.abs().sum() > 0


def test_published_sizes_have_their_parameter_counts():
    small, large = qwen3_5_moe_size("35B-A3B"), qwen3_5_moe_size("397B-A17B")
    assert 34e9 < small.num_params < 36e9 and 2.5e9 < small.num_active_params < 3.5e9
    assert 390e9 < large.num_params < 400e9 and 16e9 < large.num_active_params < 18e9
