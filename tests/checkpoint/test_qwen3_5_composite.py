"""A Qwen3.5 conditional-generation checkpoint (what Qwen releases: the text model under
`model.language_model.` beside the vision tower `model.visual`) written by transformers: Temper
loads its text model with transformers' text logits, and every export (plain, LoRA merged)
is again a `Qwen3_5ForConditionalGeneration` that transformers loads with the vision tower
bitwise as it was and Temper's logits; a PEFT adapter loads onto the released layout. Dense
(tied and untied) and MoE."""

from __future__ import annotations

import json

import pytest
import torch

from temper.checkpoint.hf import load_pretrained, save_pretrained
from temper.checkpoint.merge import save_merged_pretrained
from temper.checkpoint.peft import save_peft_adapter
from temper.models.lora import LoraConfig, apply_lora

pytest.importorskip("transformers")

VOCAB = 97
TEXT = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 24,
    "linear_conv_kernel_dim": 4,
    # As released: interleaved multimodal RoPE sections over the rotated quarter of each head
    # (text alone gives every section the same position: plain RoPE).
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10_000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [2, 1, 1],
        "mrope_interleaved": True,
    },
    "max_position_embeddings": 512,
}
VISION = {
    "depth": 1,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "patch_size": 4,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "out_hidden_size": 64,
    "num_position_embeddings": 16,
}


def _tokens(*, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 37), generator=torch.Generator().manual_seed(seed))


MOE = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
}


def tiny_hf_qwen3_5_vl(*, variant: str, tie: bool, seed: int = 0):
    """A random tiny Qwen3_5(Moe)ForConditionalGeneration, zero-initialised norms perturbed."""
    import transformers

    moe = variant == "moe"
    config_class = transformers.Qwen3_5MoeConfig if moe else transformers.Qwen3_5Config
    model_class = (
        transformers.Qwen3_5MoeForConditionalGeneration
        if moe
        else transformers.Qwen3_5ForConditionalGeneration
    )
    text = {**TEXT, **MOE} if moe else TEXT
    config = config_class(text_config=text, vision_config=VISION, tie_word_embeddings=tie)
    torch.manual_seed(seed)
    model = model_class(config).float().eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name or name.endswith("dt_bias"):
                parameter.add_(0.1 * torch.randn_like(parameter))
    return model


@pytest.fixture(
    scope="module",
    params=[("dense", False), ("dense", True), ("moe", False)],
    ids=["dense-untied", "dense-tied", "moe-untied"],
)
def checkpoint(request, tmp_path_factory):
    variant, tie = request.param
    hf_model = tiny_hf_qwen3_5_vl(variant=variant, tie=tie, seed=int(tie))
    directory = tmp_path_factory.mktemp("qwen3_5_vl")
    hf_model.save_pretrained(directory)
    return hf_model, directory


def _reload(directory, *, like):
    """transformers' model of `directory`, of the same class as `like`."""
    reloaded = type(like).from_pretrained(directory).float().eval()
    config = json.loads((directory / "config.json").read_text())
    assert config["architectures"] == [type(like).__name__]
    return reloaded


def _assert_vision_tower_is(actual, expected) -> None:
    expected_state = {k: v for k, v in expected.state_dict().items() if ".visual." in k}
    actual_state = {k: v for k, v in actual.state_dict().items() if ".visual." in k}
    assert expected_state and actual_state.keys() == expected_state.keys()
    for key, value in expected_state.items():
        assert torch.equal(actual_state[key], value), key


def test_the_text_model_matches_transformers(checkpoint):
    hf_model, directory = checkpoint
    model = load_pretrained(directory).eval()
    assert model.config.tie_embeddings == hf_model.config.tie_word_embeddings
    assert not any("visual" in key for key in model.state_dict())
    tokens_BT = _tokens(seed=1)
    with torch.no_grad():
        expected_BTV = hf_model(input_ids=tokens_BT).logits
        torch.testing.assert_close(model(tokens_BT), expected_BTV, rtol=0, atol=1e-5)


def test_export_is_the_same_architecture_with_the_same_vision_tower(checkpoint, tmp_path):
    hf_model, directory = checkpoint
    model = load_pretrained(directory).eval()
    with torch.no_grad():
        model.blocks[3].attention.wo.weight.mul_(1.5)  # a trained text weight
    out = save_pretrained(model, tmp_path / "export", max_shard_bytes=200_000)
    config = json.loads((out / "config.json").read_text())
    assert config["text_config"]["rope_parameters"]["mrope_section"] == [2, 1, 1]
    reloaded = _reload(out, like=hf_model)
    _assert_vision_tower_is(reloaded, hf_model)
    tokens_BT = _tokens(seed=2)
    with torch.no_grad():
        torch.testing.assert_close(
            reloaded(input_ids=tokens_BT).logits, model(tokens_BT), rtol=0, atol=1e-5
        )
    assert load_pretrained(out).config == model.config


def _adapted(directory):
    model = load_pretrained(directory).eval()
    # The MLPs and the unembedding (which a tied model's merge unties).
    apply_lora(model, LoraConfig(rank=2, alpha=4.0, train_attn=False, seed=5))
    with torch.no_grad():
        for index, (name, parameter) in enumerate(model.named_parameters()):
            if name.endswith("lora_B"):
                generator = torch.Generator().manual_seed(index)
                parameter.copy_(0.05 * torch.randn(parameter.shape, generator=generator))
    return model


def test_merged_lora_export_keeps_the_vision_tower(checkpoint, tmp_path):
    hf_model, directory = checkpoint
    model = _adapted(directory)
    reloaded = _reload(save_merged_pretrained(model, tmp_path / "merged"), like=hf_model)
    _assert_vision_tower_is(reloaded, hf_model)
    tokens_BT = _tokens(seed=3)
    with torch.no_grad():
        torch.testing.assert_close(
            reloaded(input_ids=tokens_BT).logits, model(tokens_BT), rtol=0, atol=1e-5
        )


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`:UserWarning")
def test_peft_adapter_loads_onto_the_conditional_generation_base(checkpoint, tmp_path):
    peft = pytest.importorskip("peft")
    hf_model, directory = checkpoint
    model = _adapted(directory)
    out = save_peft_adapter(model, tmp_path / "adapter", base_model_name_or_path=str(directory))
    assert not any("visual" in path.name for path in out.iterdir())
    peft_model = peft.PeftModel.from_pretrained(_reload(directory, like=hf_model), out).eval()
    tokens_BT = _tokens(seed=4)
    with torch.no_grad():
        torch.testing.assert_close(
            peft_model(input_ids=tokens_BT).logits, model(tokens_BT), rtol=0, atol=1e-5
        )
