"""LoRA adapters: what is trainable, exact no-op at init, merging, training and dtypes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from temper.checkpoint.merge import merged_model
from temper.models.build import materialize
from temper.models.common.logprobs import forward_logprobs
from temper.models.lora import (
    LoraConfig,
    LoraLinear,
    LoraUnembedding,
    apply_lora,
    lora_modules,
    lora_state_dict,
    merged_config,
    merged_state_dict,
)
from temper.models.qwen3.model import Qwen3

VOCAB = 50


def _model(*, tie: bool = False, dtype: torch.dtype = torch.float32, seed: int = 0) -> Qwen3:
    config = Qwen3.Config(
        vocab_size=VOCAB,
        dim=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        ffn_dim=64,
        tie_embeddings=tie,
        attention_bias=True,
    )
    return materialize(config, dtype=dtype, seed=seed)


def _tokens(batch: int = 3, length: int = 11, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _randomize_B(model, *, std: float = 0.2, seed: int = 1) -> None:
    generator = torch.Generator().manual_seed(seed)
    for module in lora_modules(model).values():
        noise = torch.randn(module.lora_B.shape, generator=generator) * std
        module.lora_B.copy_(noise)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"rank": 0}, "rank"),
        ({"rank": True}, "rank"),
        ({"rank": 2.0}, "rank"),
        ({"rank": 4, "alpha": 0.0}, "alpha"),
        ({"rank": 4, "alpha": float("nan")}, "alpha"),
        ({"rank": 4, "train_attn": False, "train_mlp": False, "train_unembed": False}, "train"),
    ],
)
def test_config_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        LoraConfig(**kwargs)


def test_only_lora_parameters_require_grad_and_base_parameters_are_kept():
    model = _model()
    before = dict(model.named_parameters())
    apply_lora(model, LoraConfig(rank=4))

    after = dict(model.named_parameters())
    for name, parameter in before.items():
        assert after[name] is parameter  # the same objects under the same keys
        assert not parameter.requires_grad
    trainable = {name for name, p in after.items() if p.requires_grad}
    assert trainable == set(after) - set(before)
    assert trainable == set(lora_state_dict(model))
    # 2 blocks x 7 projections x (A, B) + the unembedding's (A, B)
    assert len(trainable) == 2 * 7 * 2 + 2
    assert "blocks.0.attention.wq.lora_A" in trainable
    assert "blocks.1.feed_forward.w_down.lora_B" in trainable
    assert {"output_adapter.lora_A", "output_adapter.lora_B"} <= trainable
    assert isinstance(model.blocks[0].attention.wq, torch.nn.Linear)


def test_targets_follow_the_config():
    model = _model()
    apply_lora(model, LoraConfig(rank=2, train_mlp=False, train_unembed=False))
    names = set(lora_modules(model))
    assert names == {f"blocks.{i}.attention.{w}" for i in (0, 1) for w in ("wq", "wk", "wv", "wo")}
    assert model.output_adapter is None

    model = _model()
    apply_lora(model, LoraConfig(rank=2, train_attn=False, train_mlp=False))
    assert set(lora_modules(model)) == {"output_adapter"}


def test_shapes_init_and_seed():
    first, second, other = _model(), _model(), _model()
    apply_lora(first, LoraConfig(rank=3, alpha=6.0, seed=7))
    apply_lora(second, LoraConfig(rank=3, alpha=6.0, seed=7))
    apply_lora(other, LoraConfig(rank=3, alpha=6.0, seed=8))
    wq = first.blocks[0].attention.wq
    assert isinstance(wq, LoraLinear)
    assert wq.lora_A.shape == (3, 32) and wq.lora_B.shape == (32, 3)
    assert wq.scale == 2.0
    assert torch.count_nonzero(wq.lora_B) == 0
    assert 0 < wq.lora_A.abs().max() <= 1 / 32**0.5  # kaiming_uniform(a=sqrt(5)) bound
    assert first.output_adapter.lora_B.shape == (VOCAB, 3)
    state, same, different = (lora_state_dict(m) for m in (first, second, other))
    assert all(torch.equal(state[key], same[key]) for key in state)
    assert not torch.equal(state["output_adapter.lora_A"], different["output_adapter.lora_A"])


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_zero_B_adapter_leaves_logits_bitwise_unchanged(tie):
    model = _model(tie=tie)
    tokens_BT = _tokens()
    with torch.no_grad():
        expected_BTV = model(tokens_BT)
        expected_BT = forward_logprobs(model, tokens_BT, tokens_BT.roll(-1, 1))
    apply_lora(model, LoraConfig(rank=4))
    with torch.no_grad():
        assert torch.equal(model(tokens_BT), expected_BTV)
        assert torch.equal(forward_logprobs(model, tokens_BT, tokens_BT.roll(-1, 1)), expected_BT)


def test_augmented_unembedding_equals_the_merged_product():
    adapter = LoraUnembedding(
        weight_VD=torch.randn(VOCAB, 32),
        lora_A_RI=torch.empty(4, 32).uniform_(-0.17, 0.17),
        alpha=8.0,
    )
    torch.nn.init.normal_(adapter.lora_B)
    hidden_BTD, weight_VD = torch.randn(2, 5, 32), torch.randn(VOCAB, 32)
    with torch.no_grad():
        augmented = F.linear(*adapter.augment(hidden_BTD, weight_VD))
        merged = F.linear(hidden_BTD, weight_VD + adapter.delta_weight())
    torch.testing.assert_close(augmented, merged, rtol=0, atol=1e-5)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_merged_plain_model_matches_the_lora_model(tie):
    model = _model(tie=tie)
    apply_lora(model, LoraConfig(rank=4, alpha=8.0))
    _randomize_B(model)
    tokens_BT = _tokens()
    plain = merged_model(model)
    assert not any(isinstance(m, LoraLinear) for m in plain.modules())
    assert plain.output_adapter is None
    with torch.no_grad():
        base_BTV = _model(tie=tie)(tokens_BT)
        lora_BTV = model(tokens_BT)
        merged_BTV = plain(tokens_BT)
    assert (lora_BTV - base_BTV).abs().max() > 1e-2  # the adapter is far from a no-op
    torch.testing.assert_close(merged_BTV, lora_BTV, rtol=0, atol=1e-5)


def test_merging_a_tied_unembedding_unties_it():
    model = _model(tie=True)
    apply_lora(model, LoraConfig(rank=2))
    _randomize_B(model)
    merged = merged_state_dict(model)
    assert merged_config(model).tie_embeddings is False
    assert model.config.tie_embeddings is True  # the model's own config is not changed
    assert torch.equal(merged["embed.weight"], model.embed.weight)
    assert not torch.equal(merged["output.weight"], model.embed.weight)
    assert not any(key.endswith(("lora_A", "lora_B")) for key in merged)

    tied_without_unembedding = _model(tie=True)
    apply_lora(tied_without_unembedding, LoraConfig(rank=2, train_unembed=False))
    assert merged_config(tied_without_unembedding).tie_embeddings is True
    assert "output.weight" not in merged_state_dict(tied_without_unembedding)


def test_merged_state_dict_has_plain_keys_and_weight_dtype():
    model = _model(dtype=torch.bfloat16)
    plain_keys = list(model.state_dict())
    apply_lora(model, LoraConfig(rank=4))
    _randomize_B(model)
    merged = merged_state_dict(model)
    assert list(merged) == plain_keys
    assert all(value.dtype == torch.bfloat16 for value in merged.values())
    wq = model.blocks[0].attention.wq
    expected = (wq.weight.float() + wq.scale * wq.lora_B.float() @ wq.lora_A.float()).bfloat16()
    assert torch.equal(merged["blocks.0.attention.wq.weight"], expected)


def test_training_changes_only_lora_tensors():
    model = _model(tie=True)
    apply_lora(model, LoraConfig(rank=4))
    base_before = {k: v.clone() for k, v in model.state_dict().items() if "lora" not in k}
    lora_before = {k: v.clone() for k, v in lora_state_dict(model).items()}
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(trainable, lr=1e-2)
    tokens_BT = _tokens(seed=3)
    losses = []
    for _ in range(3):
        loss = -forward_logprobs(model, tokens_BT[:, :-1], tokens_BT[:, 1:]).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in base_before.items())
    assert all(not torch.equal(after[k], v) for k, v in lora_before.items())


def test_bf16_model_gets_bf16_adapters_that_train():
    model = _model(dtype=torch.bfloat16)
    apply_lora(model, LoraConfig(rank=4))
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    _randomize_B(model)
    tokens_BT = _tokens()
    loss = -forward_logprobs(model, tokens_BT[:, :-1], tokens_BT[:, 1:]).sum()
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and g.dtype == torch.bfloat16 for g in grads)
    assert all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)


def test_apply_twice_and_bad_config_type_raise():
    model = _model()
    with pytest.raises(TypeError, match="LoraConfig"):
        apply_lora(model, {"rank": 4})
    apply_lora(model, LoraConfig(rank=4))
    with pytest.raises(ValueError, match="already has LoRA"):
        apply_lora(model, LoraConfig(rank=4))


@pytest.mark.parametrize(
    ("switch", "part", "valid"),
    [
        ("train_attn", "attention", "valid for this model: train_mlp, train_unembed"),
        ("train_mlp", "feed_forward", "valid for this model: train_attn, train_unembed"),
    ],
)
def test_a_switch_whose_projections_the_model_lacks_fails_before_any_change(switch, part, valid):
    model = _model()
    # A block without the switch's linears, as a family with another attention or
    # feed-forward would have.
    setattr(model.blocks[1], part, torch.nn.Identity())
    before = {name: p.requires_grad for name, p in model.named_parameters()}
    with pytest.raises(ValueError, match=rf"LoraConfig\.{switch}=True.*block 1's {part}") as error:
        apply_lora(model, LoraConfig(rank=2))
    assert valid in str(error.value) and f"set {switch}=False" in str(error.value)
    assert not lora_modules(model)
    assert {name: p.requires_grad for name, p in model.named_parameters()} == before
    apply_lora(model, LoraConfig(rank=2, **{switch: False}))  # the switches it names work
    assert lora_modules(model)
