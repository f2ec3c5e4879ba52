"""Qwen3.5 <-> Hugging Face (the text-only Qwen3_5ForCausalLM layout): config.json fields and
state-dict key names.

Attention, MLP, norms and embeddings use the dense decoder's names (hf_names.py); the Gated
DeltaNet's are in hf_hybrid_names.py. Tensor values map one to one (the zero-centred norms
store the same offset weight HF does). Fields Temper does not implement fail here, naming the
field, before any weight is read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from temper.models.common import hf_names
from temper.models.common.hf_hybrid_names import (
    check_hybrid_fields,
    hybrid_config_to_hf,
    hybrid_fields_from_hf,
    with_linear_attention,
)
from temper.models.common.hf_names import decoder_config_to_hf, decoder_fields_from_hf
from temper.models.qwen3_5.model import Qwen3_5

HF_ARCHITECTURE = "Qwen3_5ForCausalLM"
HF_MODEL_TYPE = "qwen3_5_text"

key_to_hf, key_from_hf = with_linear_attention(hf_names.key_to_hf, hf_names.key_from_hf)

__all__ = ["config_from_hf", "config_to_hf", "key_from_hf", "key_to_hf"]


def config_from_hf(hf_config: Mapping[str, Any]) -> Qwen3_5.Config:
    """Build our config from a HF Qwen3.5 text config.json dict."""
    check_hybrid_fields(hf_config, family="Qwen3.5")
    if "intermediate_size" not in hf_config:
        raise ValueError("config.json: missing required Qwen3.5 field intermediate_size")
    fields = decoder_fields_from_hf(hf_config, norm_eps=1e-6, max_seq_len=32_768)
    fields["head_dim"] = hf_config.get("head_dim") or 256
    return Qwen3_5.Config(**fields, **hybrid_fields_from_hf(hf_config))


def config_to_hf(config: Qwen3_5.Config, *, dtype_name: str) -> dict[str, Any]:
    """A config.json dict that transformers (5.x) loads as Qwen3_5ForCausalLM."""
    return {
        "architectures": [HF_ARCHITECTURE],
        "model_type": HF_MODEL_TYPE,
        **decoder_config_to_hf(config, dtype_name=dtype_name),
        **hybrid_config_to_hf(config),
    }
