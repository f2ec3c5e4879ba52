"""Qwen3-MoE decoder: Qwen3's attention (GQA with per-head q/k RMSNorm, RoPE) with routed
SwiGLU experts (softmax top-k router, temper/models/common/moe.py) in its sparse layers and a
dense SwiGLU in the others.

Single-device code. Sharding lives in parallelize.py and HF naming (one tensor per expert) in
state_dict_adapter.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from temper.config.configurable import Configurable
from temper.models.common.decoder import Decoder
from temper.models.common.moe_decoder import MoEDecoderConfig


class Qwen3Moe(Decoder, Configurable):
    @dataclass(kw_only=True)
    class Config(MoEDecoderConfig, Configurable.Config):
        """Qwen3-MoE shapes (fields documented on MoEDecoderConfig and DecoderConfig); named
        sizes are in sizes.py."""

        @property
        def attention_params(self) -> int:
            attention = self.dim * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
            attention += 2 * self.head_dim  # q/k norms
            if self.attention_bias:
                attention += self.head_dim * (self.num_heads + 2 * self.num_kv_heads) + self.dim
            return attention

        def mixer_params(self) -> int:
            return self.num_layers * (self.attention_params + 2 * self.dim)

    def __init__(self, config: Config) -> None:
        super().__init__(config, qk_norm=True)
