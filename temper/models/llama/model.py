"""Llama 3 dense decoder: GQA without q/k norms, RoPE (optionally with Llama 3.1's frequency
scaling), SwiGLU, tied (3.2 1B/3B) or untied (3.1 8B/70B) embeddings.

The whole model is the shared dense decoder (temper/models/common/decoder.py) with q/k norms
off. Single-device code; sharding lives in parallelize.py and HF naming in
state_dict_adapter.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from temper.config.configurable import Configurable
from temper.models.common.decoder import Decoder, DecoderConfig


class Llama(Decoder, Configurable):
    @dataclass(kw_only=True)
    class Config(DecoderConfig, Configurable.Config):
        """Llama 3 shapes (fields documented on DecoderConfig); named sizes are in sizes.py."""

        rope_theta: float = 500_000.0
        """RoPE base frequency."""
        norm_eps: float = 1e-5
        """Epsilon of every RMSNorm."""
        max_seq_len: int = 131_072
        """Longest sequence (prompt + completion) the model is used with."""

        @property
        def num_params(self) -> int:
            """Parameter count (tied embeddings counted once)."""
            attention = self.dim * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
            if self.attention_bias:
                attention += self.head_dim * (self.num_heads + 2 * self.num_kv_heads) + self.dim
            block = attention + 3 * self.dim * self.ffn_dim + 2 * self.dim
            embeddings = self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)
            return self.num_layers * block + embeddings + self.dim

    def __init__(self, config: Config) -> None:
        super().__init__(config, qk_norm=False)
