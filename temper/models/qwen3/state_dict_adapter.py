"""Qwen3 <-> Hugging Face: config.json fields and state-dict key names.

The key names are the dense decoder's, shared with Llama (temper/models/common/hf_names.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from temper.models.common.hf_names import (
    decoder_config_to_hf,
    decoder_fields_from_hf,
    key_from_hf,
    key_to_hf,
)
from temper.models.qwen3.model import Qwen3

HF_ARCHITECTURE = "Qwen3ForCausalLM"
HF_MODEL_TYPE = "qwen3"

__all__ = ["config_from_hf", "config_to_hf", "key_from_hf", "key_to_hf", "to_hf"]


def to_hf(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    return {key_to_hf(key): value for key, value in state_dict.items()}


def unknown_hf_keys(hf_keys: Iterable[str]) -> list[str]:
    return sorted(key for key in hf_keys if key_from_hf(key) is None)


def rope_theta(hf_config: Mapping[str, Any]) -> float:
    """RoPE base of a Qwen3-style config.json; any RoPE type but the default fails."""
    # transformers >= 5 nests RoPE settings in `rope_parameters`; 4.x has `rope_theta` and
    # `rope_scaling` at the top level.
    rope = hf_config.get("rope_parameters") or {}
    scaling = hf_config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type")
    if rope_type not in (None, "default"):
        raise ValueError(
            f"config.json: RoPE type {rope_type!r} is not supported; Temper's Qwen3 implements "
            "the default (unscaled) RoPE only"
        )
    theta = rope.get("rope_theta", hf_config.get("rope_theta"))
    if theta is None:
        raise ValueError("config.json: missing rope_theta (or rope_parameters.rope_theta)")
    return float(theta)


def check_qwen3_fields(hf_config: Mapping[str, Any], *, family: str) -> None:
    """The config.json checks Qwen3 and Qwen3-MoE share: no sliding window, silu, the
    required shape fields."""
    if hf_config.get("use_sliding_window"):
        raise ValueError(f"config.json: use_sliding_window=true is not supported for {family}")
    if hf_config.get("hidden_act", "silu") != "silu":
        raise ValueError(
            f"config.json: hidden_act {hf_config['hidden_act']!r} is not supported; "
            f"{family} uses 'silu'"
        )
    required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
    required += ("intermediate_size",)
    missing = [name for name in required if name not in hf_config]
    if missing:
        raise ValueError(f"config.json: missing required {family} fields {missing}")


def config_from_hf(hf_config: Mapping[str, Any]) -> Qwen3.Config:
    """Build our config from a HF Qwen3 config.json dict."""
    check_qwen3_fields(hf_config, family="Qwen3")
    return Qwen3.Config(
        **decoder_fields_from_hf(hf_config, norm_eps=1e-6, max_seq_len=40_960),
        rope_theta=rope_theta(hf_config),
    )


def config_to_hf(config: Qwen3.Config, *, dtype_name: str) -> dict[str, Any]:
    """A config.json dict that transformers (4.51+ and 5.x) loads as Qwen3ForCausalLM."""
    return {
        "architectures": [HF_ARCHITECTURE],
        "model_type": HF_MODEL_TYPE,
        **decoder_config_to_hf(config, dtype_name=dtype_name),
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": config.num_layers,
    }
