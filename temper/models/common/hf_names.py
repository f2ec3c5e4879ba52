"""Dense decoder <-> Hugging Face state-dict key names (Qwen3 and Llama share them).

Our modules are named for reading (`blocks.3.attention.wq`); HF checkpoints use
`model.layers.3.self_attn.q_proj`. Tensor values are never transformed: both sides use the same
rotate-half RoPE layout, so every tensor maps one to one. A family without q/k norms (Llama)
simply has no keys that map to them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from temper.models.common.decoder import DecoderConfig

_GLOBAL_KEYS = {
    "embed.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_KEYS = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq.bias": "self_attn.q_proj.bias",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wv.bias": "self_attn.v_proj.bias",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.wo.bias": "self_attn.o_proj.bias",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w_gate.weight": "mlp.gate_proj.weight",
    "feed_forward.w_up.weight": "mlp.up_proj.weight",
    "feed_forward.w_down.weight": "mlp.down_proj.weight",
}


def decoder_config_to_hf(config: DecoderConfig, *, dtype_name: str) -> dict[str, Any]:
    """The config.json fields every dense decoder family writes alike; a family's adapter adds
    its architecture, model type and RoPE fields."""
    return {
        "vocab_size": config.vocab_size,
        "hidden_size": config.dim,
        "intermediate_size": config.ffn_dim,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_seq_len,
        "initializer_range": config.init_std,
        "rms_norm_eps": config.norm_eps,
        "tie_word_embeddings": config.tie_embeddings,
        "rope_theta": config.rope_theta,
        "attention_bias": config.attention_bias,
        "attention_dropout": 0.0,
        "use_cache": True,
        "torch_dtype": dtype_name,
        "dtype": dtype_name,
    }


def decoder_fields_from_hf(
    hf_config: Mapping[str, Any], *, norm_eps: float, max_seq_len: int
) -> dict[str, Any]:
    """The DecoderConfig fields every family reads alike from config.json (the required shape
    fields checked by the family first); `norm_eps` and `max_seq_len` are the family's defaults
    for configs that leave them out. A family adds its RoPE and its own fields."""
    num_heads = hf_config["num_attention_heads"]
    return {
        "vocab_size": hf_config["vocab_size"],
        "dim": hf_config["hidden_size"],
        "num_layers": hf_config["num_hidden_layers"],
        "num_heads": num_heads,
        "num_kv_heads": hf_config.get("num_key_value_heads") or num_heads,
        "head_dim": hf_config.get("head_dim") or hf_config["hidden_size"] // num_heads,
        "ffn_dim": hf_config["intermediate_size"],
        "norm_eps": hf_config.get("rms_norm_eps", norm_eps),
        "tie_embeddings": hf_config.get("tie_word_embeddings", False),
        "attention_bias": hf_config.get("attention_bias", False),
        "max_seq_len": hf_config.get("max_position_embeddings", max_seq_len),
        "init_std": hf_config.get("initializer_range", 0.02),
    }


_HF_BLOCK_KEYS = {hf: ours for ours, hf in _BLOCK_KEYS.items()}
_HF_GLOBAL_KEYS = {hf: ours for ours, hf in _GLOBAL_KEYS.items()}
_OUR_BLOCK = re.compile(r"blocks\.(\d+)\.(.+)")
_HF_BLOCK = re.compile(r"model\.layers\.(\d+)\.(.+)")


def key_to_hf(key: str) -> str:
    """Our state-dict key -> the HF checkpoint key."""
    if key in _GLOBAL_KEYS:
        return _GLOBAL_KEYS[key]
    match = _OUR_BLOCK.fullmatch(key)
    if match is None or match.group(2) not in _BLOCK_KEYS:
        raise KeyError(f"no HF name for decoder parameter {key!r}")
    return f"model.layers.{match.group(1)}.{_BLOCK_KEYS[match.group(2)]}"


def key_from_hf(hf_key: str) -> str | None:
    """HF checkpoint key -> our key, or None for a tensor the dense decoder does not use."""
    if hf_key in _HF_GLOBAL_KEYS:
        return _HF_GLOBAL_KEYS[hf_key]
    match = _HF_BLOCK.fullmatch(hf_key)
    if match is None or match.group(2) not in _HF_BLOCK_KEYS:
        return None
    return f"blocks.{match.group(1)}.{_HF_BLOCK_KEYS[match.group(2)]}"
