"""Qwen3 dense decoder: GQA with per-head q/k RMSNorm, RoPE, SwiGLU, optionally tied embeddings.

Single-device code. Sharding, compile and the like are applied from outside (parallelize.py);
HF naming lives only in state_dict_adapter.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from temper.config.configurable import Configurable
from temper.models.common.decoder import Decoder, DecoderConfig


class Qwen3(Decoder, Configurable):
    @dataclass(kw_only=True)
    class Config(DecoderConfig, Configurable.Config):
        """Qwen3 shapes (fields documented on DecoderConfig); named sizes are in sizes.py."""

        @property
        def num_params(self) -> int:
            """Parameter count (tied embeddings counted once)."""
            attention = self.dim * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
            attention += 2 * self.head_dim  # q/k norms
            if self.attention_bias:
                attention += self.head_dim * (self.num_heads + 2 * self.num_kv_heads) + self.dim
            block = attention + 3 * self.dim * self.ffn_dim + 2 * self.dim
            embeddings = self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)
            return self.num_layers * block + embeddings + self.dim

    def __init__(self, config: Config) -> None:
        super().__init__(config, qk_norm=True)
