"""LoRA on Qwen3.5 and Qwen3.5-MoE: the targets (each Gated DeltaNet's five projections, the
gated attention's q with its gate half, k, v, o, the MLP or the routed and shared experts; never
the conv, decay or norm parameters, the router or the shared expert's gate), a no-op at init,
the merged model, the init a sharded model draws again, and a switch the model cannot honour
refused before anything changes, naming the field and the valid ones."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from temper.checkpoint.sharded_load import init_lora_shards
from temper.models import materialize
from temper.models.lora import (
    LoraConfig,
    apply_lora,
    lora_modules,
    lora_state_dict,
    merged_config,
    merged_state_dict,
)
from temper.models.qwen3_5 import qwen3_5_size
from temper.models.qwen3_5_moe import qwen3_5_moe_size

VOCAB = 31
SIZES = {"qwen3_5": qwen3_5_size, "qwen3_5_moe": qwen3_5_moe_size}
LINEAR = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")


def _model(family: str, *, device: str = "cpu"):
    config = dataclasses.replace(SIZES[family]("tiny", vocab_size=VOCAB), init_std=0.1)
    init = "empty" if device == "meta" else "random"
    return materialize(config, seed=3, dtype="float32", device=device, init=init).eval()


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("family", SIZES)
def test_targets_are_the_mixers_projections_and_the_feed_forwards(family):
    model = _model(family)
    apply_lora(model, LoraConfig(rank=2, train_unembed=False))
    linear = {f"blocks.{i}.linear_attention.{name}" for i in range(3) for name in LINEAR}
    attention = {f"blocks.3.attention.{name}" for name in ("wq", "wk", "wv", "wo")}
    if family == "qwen3_5":
        mlp = {
            f"blocks.{i}.feed_forward.{w}" for i in range(4) for w in ("w_gate", "w_up", "w_down")
        }
    else:
        mlp = {
            f"blocks.{i}.feed_forward.{part}"
            for i in range(4)
            for w in ("w_gate", "w_up", "w_down")
            for part in (f"experts.{w}_adapter", f"shared_expert.{w}")
        }
    assert set(lora_modules(model)) == linear | attention | mlp
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(lora_state_dict(model))
    assert not any(
        part in name
        for name in trainable
        for part in ("conv_weight", "A_log", "dt_bias", "norm", "router", "shared_expert_gate")
    )


@pytest.mark.parametrize("family", SIZES)
def test_zero_B_is_a_no_op_and_the_merge_computes_the_lora_model(family):
    model = _model(family)
    tokens_BT = _tokens()
    with torch.no_grad():
        base_BTV = model(tokens_BT)
    apply_lora(model, LoraConfig(rank=4, alpha=8.0))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens_BT), base_BTV, rtol=0, atol=1e-5)
        generator = torch.Generator().manual_seed(1)
        for module in lora_modules(model).values():
            module.lora_B.copy_(torch.randn(module.lora_B.shape, generator=generator) * 0.05)
        lora_BTV = model(tokens_BT)
    plain = materialize(merged_config(model), dtype="float32", init="empty").eval()
    plain.load_state_dict(merged_state_dict(model))
    with torch.no_grad():
        assert (lora_BTV - base_BTV).abs().max() > 1e-2
        # To float rounding (a merged weight rounds otherwise than the low-rank path), on
        # logits of several units here.
        torch.testing.assert_close(plain(tokens_BT), lora_BTV, rtol=0, atol=1e-4)


@pytest.mark.parametrize("family", SIZES)
def test_a_sharded_model_draws_apply_loras_adapters_again(family):
    config = LoraConfig(rank=3, seed=11)
    model = _model(family)
    apply_lora(model, config)
    meta = _model(family, device="meta")
    apply_lora(meta, config)
    meta.to_empty(device="cpu")
    init_lora_shards(meta, lora=config)
    expected, drawn = lora_state_dict(model), lora_state_dict(meta)
    assert drawn.keys() == expected.keys()
    assert all(torch.equal(drawn[key], expected[key]) for key in expected)


def test_a_mixer_without_the_projections_is_refused_naming_the_field():
    model = _model("qwen3_5")
    del model.blocks[1].linear_attention.in_proj_z  # a Gated DeltaNet lacking one projection
    with pytest.raises(
        ValueError, match=r"LoraConfig\.train_attn=True.*block 1's linear_attention"
    ) as error:
        apply_lora(model, LoraConfig(rank=2))
    assert "in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj" in str(error.value)
    assert "valid for this model: train_mlp, train_unembed" in str(error.value)
    assert not lora_modules(model)
