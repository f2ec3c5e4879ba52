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

        def _count(self, *, active: bool) -> int:
            blocks = self.num_layers * (self.attention_params + 2 * self.dim)
            blocks += self.feed_forward_params(active=active)
            embeddings = self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)
            return blocks + embeddings + self.dim

        @property
        def num_params(self) -> int:
            """Parameter count, every expert included (tied embeddings counted once)."""
            return self._count(active=False)

        @property
        def num_active_params(self) -> int:
            """Parameters one token uses: its top_k experts per sparse layer, and the rest."""
            return self._count(active=True)

    def __init__(self, config: Config) -> None:
        super().__init__(config, qk_norm=True)
