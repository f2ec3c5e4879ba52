"""LoRA on a Qwen3-MoE model: which weights get adapters (attention, dense layers, every routed
expert; never the router), a no-op at init (to float rounding), the merged model, the init a
sharded model draws again, the sampler's merged weights, and the shapes memory plans count."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from temper.checkpoint.gather import sampler_state_dict
from temper.checkpoint.sharded_load import init_lora_shards
from temper.job.model_bytes import ModelShapes
from temper.models import materialize
from temper.models.lora import (
    LoraConfig,
    apply_lora,
    initial_lora_A,
    lora_modules,
    lora_state_dict,
    merged_config,
    merged_state_dict,
)
from temper.models.lora_experts import ExpertsLora, LoraGroupedExperts
from temper.models.qwen3_moe import Qwen3Moe, qwen3_moe_size

VOCAB = 31


def _model(*, tie: bool = True, dense_layers: tuple[int, ...] = (1,), device: str = "cpu"):
    config = dataclasses.replace(
        qwen3_moe_size("tiny", vocab_size=VOCAB),
        num_layers=3,
        mlp_only_layers=dense_layers,
        tie_embeddings=tie,
        init_std=0.1,  # logits of order 2, routing far from ties
    )
    init = "empty" if device == "meta" else "random"
    return materialize(config, seed=3, dtype="float32", device=device, init=init).eval()


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (3, 12), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def _randomize_B(model, *, std: float = 0.05) -> None:
    generator = torch.Generator().manual_seed(1)
    for module in lora_modules(model).values():
        module.lora_B.copy_(torch.randn(module.lora_B.shape, generator=generator) * std)


def test_train_mlp_adapts_dense_layers_and_every_expert_but_not_the_router():
    model = _model()
    before = dict(model.named_parameters())
    apply_lora(model, LoraConfig(rank=2, train_unembed=False))

    after = dict(model.named_parameters())
    assert all(after[name] is parameter for name, parameter in before.items())
    assert not any(parameter.requires_grad for parameter in before.values())
    trainable = {name for name, parameter in after.items() if parameter.requires_grad}
    assert trainable == set(lora_state_dict(model))
    projections = ("w_gate", "w_up", "w_down")
    experts = {f"blocks.{i}.feed_forward.experts.{w}_adapter" for i in (0, 2) for w in projections}
    dense = {f"blocks.1.feed_forward.{w}" for w in projections}
    attention = {f"blocks.{i}.attention.{w}" for i in range(3) for w in ("wq", "wk", "wv", "wo")}
    assert set(lora_modules(model)) == experts | dense | attention
    assert not any("router" in name for name in trainable)

    moe = model.blocks[0].feed_forward
    assert isinstance(moe.experts, LoraGroupedExperts)
    E, D, F, R = 8, 128, 128, 2
    gate, down = moe.experts.w_gate_adapter, moe.experts.w_down_adapter
    assert isinstance(gate, ExpertsLora)
    assert (gate.lora_A.shape, gate.lora_B.shape) == ((E, R, D), (E, F, R))
    assert (down.lora_A.shape, down.lora_B.shape) == ((E, R, F), (E, D, R))
    assert torch.count_nonzero(gate.lora_B) == 0
    assert 0 < gate.lora_A.abs().max() <= 1 / D**0.5  # a dense adapter's kaiming bound


def test_train_mlp_alone_on_an_all_sparse_model_adapts_only_experts():
    model = _model(dense_layers=())
    apply_lora(model, LoraConfig(rank=2, train_attn=False, train_unembed=False))
    assert all(isinstance(module, ExpertsLora) for module in lora_modules(model).values())
    assert len(lora_modules(model)) == 3 * 3


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_zero_B_adapters_leave_logits_unchanged(tie):
    model = _model(tie=tie)
    tokens_BT = _tokens()
    with torch.no_grad():
        expected_BTV = model(tokens_BT)
    apply_lora(model, LoraConfig(rank=4))
    with torch.no_grad():
        # To float rounding, not bitwise: adapted experts run gate and up as two products
        # (grouped_linear), the plain experts' CPU kernel as one [2F, D] product.
        torch.testing.assert_close(model(tokens_BT), expected_BTV, rtol=0, atol=1e-5)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_merged_plain_model_and_sampler_weights_match_the_lora_model(tie):
    model = _model(tie=tie)
    apply_lora(model, LoraConfig(rank=4, alpha=8.0))
    _randomize_B(model)
    merged = merged_state_dict(model)
    plain = materialize(merged_config(model), dtype="float32", init="empty").eval()
    plain.load_state_dict(merged)
    assert isinstance(plain, Qwen3Moe)
    tokens_BT = _tokens()
    with torch.no_grad():
        lora_BTV = model(tokens_BT)
        assert (lora_BTV - _model(tie=tie)(tokens_BT)).abs().max() > 1e-2  # far from a no-op
        torch.testing.assert_close(plain(tokens_BT), lora_BTV, rtol=0, atol=1e-5)
    # What a trainer streams to its sampler is the same merge, bitwise.
    sampler = sampler_state_dict(model)
    assert sampler.keys() == merged.keys()
    assert all(torch.equal(sampler[key], merged[key]) for key in merged)


def test_initial_lora_A_and_the_sharded_init_give_apply_loras_adapters():
    config = LoraConfig(rank=3, seed=11)
    model = _model()
    expected = {name: lora_A.clone() for name, lora_A in initial_lora_A(model, config)}
    apply_lora(model, config)
    applied = lora_state_dict(model)
    assert expected["blocks.0.feed_forward.experts.w_up_adapter"].shape == (8, 3, 128)
    for name, lora_A in expected.items():
        assert torch.equal(applied[f"{name}.lora_A"], lora_A), name

    # A model whose adapters were applied on the meta device gets them drawn again.
    meta = _model(device="meta")
    apply_lora(meta, config)
    meta.to_empty(device="cpu")
    init_lora_shards(meta, lora=config)
    drawn = lora_state_dict(meta)
    assert drawn.keys() == applied.keys()
    assert all(torch.equal(drawn[key], applied[key]) for key in applied)


def test_another_seed_draws_other_expert_adapters():
    first, second = _model(), _model()
    apply_lora(first, LoraConfig(rank=2, seed=1))
    apply_lora(second, LoraConfig(rank=2, seed=2))
    key = "blocks.0.feed_forward.experts.w_gate_adapter.lora_A"
    assert not torch.equal(lora_state_dict(first)[key], lora_state_dict(second)[key])


def test_model_shapes_count_expert_adapters_at_their_rank():
    config = _model(device="meta").config
    shapes = ModelShapes.of(config, lora_rank=4)
    model = _model(device="meta")
    apply_lora(model, LoraConfig(rank=4))
    assert list(shapes.trainer) == [
        (name, tuple(p.shape), p.requires_grad) for name, p in model.named_parameters()
    ]
    stacked = model.blocks[0].feed_forward.experts.w_gate.numel()
    assert shapes.largest_adapted_numel >= stacked  # a merge upcasts a whole stacked weight
