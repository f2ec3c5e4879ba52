"""Random tiny HF Qwen3 and Llama models built from a config (no hub), for numerics references."""

from __future__ import annotations

from pathlib import Path

import torch


def tiny_hf_qwen3(
    *,
    vocab_size: int = 97,
    tie: bool = True,
    attention_bias: bool = False,
    seed: int = 0,
    num_layers: int = 2,
):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rope_theta=10_000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
        attention_bias=attention_bias,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).float().eval()
    # The HF init leaves norms at 1 and biases at 0; perturb them so a mix-up would show.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                param.add_(0.1 * torch.randn_like(param))
    return model


def save_hf(model, directory: Path, **kwargs) -> Path:
    model.save_pretrained(directory, **kwargs)
    return directory


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Far below max_position_embeddings (512): the scaled band holds most frequencies.
    "original_max_position_embeddings": 64,
}


def tiny_hf_llama(
    *,
    vocab_size: int = 97,
    tie: bool = True,
    rope_scaling: dict | None = LLAMA3_ROPE,
    seed: int = 0,
    num_layers: int = 2,
):
    """A random tiny HF Llama 3 (GQA, no q/k norms), by default with llama3 RoPE scaling."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rope_theta=10_000.0,
        rope_scaling=rope_scaling,
        rms_norm_eps=1e-5,
        max_position_embeddings=512,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float().eval()
    # The HF init leaves norms at 1; perturb them so a mix-up would show.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.1 * torch.randn_like(param))
    return model


def tiny_hf_qwen3_moe(
    *,
    vocab_size: int = 97,
    tie: bool = False,
    norm_topk_prob: bool = True,
    mlp_only_layers: tuple[int, ...] = (1,),
    decoder_sparse_step: int = 1,
    num_layers: int = 3,
    seed: int = 0,
):
    """A random tiny HF Qwen3-MoE: 8 experts of width 32, 2 per token; layer 1 dense by
    default. The router is drawn wide so that top-k choices are far apart."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=160,
        moe_intermediate_size=32,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=norm_topk_prob,
        mlp_only_layers=list(mlp_only_layers),
        decoder_sparse_step=decoder_sparse_step,
        rope_theta=10_000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=512,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.1 * torch.randn_like(param))
            elif name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 0.5)
            elif ".mlp.experts." in name:
                param.normal_(0.0, 0.05)
    return model


def assert_export_reloads_exactly(source, model, export_dir: Path, *, tokens_BT, hf_class):
    """transformers loads `export_dir` (what Temper exported of `model`, itself loaded from
    `source`'s checkpoint) as `hf_class` with `source`'s tensors bit for bit and `model`'s
    logits, and Temper loads it back with the same config. Returns transformers' model."""
    from transformers import AutoModelForCausalLM

    from temper.checkpoint.hf import load_pretrained

    reloaded = AutoModelForCausalLM.from_pretrained(export_dir).float().eval()
    assert isinstance(reloaded, hf_class)
    expected, actual = source.state_dict(), reloaded.state_dict()
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(actual[key], value), key
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens_BT).logits, model(tokens_BT), rtol=0, atol=1e-5)
    assert load_pretrained(export_dir).config == model.config
    return reloaded


def tiny_hf_qwen3_5(
    *,
    vocab_size: int = 97,
    tie: bool = True,
    num_layers: int = 4,
    layer_types: list[str] | None = None,
    seed: int = 0,
):
    """A random tiny HF Qwen3.5 (text only): layers 0-2 Gated DeltaNet (2 key heads of 16, 4
    value heads of 24), layer 3 gated full attention (4 heads of 32, a quarter rotated). The
    zero-initialised norms, dt_bias and the gated norm are perturbed so a mix-up would show."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=24,
        linear_conv_kernel_dim=4,
        layer_types=layer_types,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10_000.0,
            "partial_rotary_factor": 0.25,
        },
        rms_norm_eps=1e-6,
        max_position_embeddings=512,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(config).float().eval()
    _perturb_hybrid(model)
    return model


def _perturb_hybrid(model) -> None:
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("dt_bias"):
                param.add_(0.1 * torch.randn_like(param))


def tiny_hf_qwen3_5_moe(*, vocab_size: int = 97, tie: bool = False, seed: int = 0):
    """A random tiny HF Qwen3.5-MoE (text only): tiny_hf_qwen3_5's mixers, 8 experts of width
    32 with 2 per token and a shared expert of width 48 in every layer. The router is drawn
    wide so that top-k choices are far apart."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    config = Qwen3_5MoeTextConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=24,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        num_experts=8,
        num_experts_per_tok=2,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10_000.0,
            "partial_rotary_factor": 0.25,
        },
        rms_norm_eps=1e-6,
        max_position_embeddings=512,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(seed)
    model = Qwen3_5MoeForCausalLM(config).float().eval()
    _perturb_hybrid(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 0.5)
            elif ".mlp.experts." in name:
                param.normal_(0.0, 0.05)
    return model
