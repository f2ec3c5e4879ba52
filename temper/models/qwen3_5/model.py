"""Qwen3.5 dense decoder: three of every four layers Gated DeltaNet (linear attention with a
recurrent state), the fourth gated full attention with partial RoPE, every layer a SwiGLU MLP,
zero-centred RMSNorms (temper/models/common/hybrid_decoder.py).

Single-device code. Sharding lives in parallelize.py and HF naming in state_dict_adapter.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from temper.config.configurable import Configurable
from temper.models.common.hybrid_decoder import HybridDecoder, HybridDecoderConfig


class Qwen3_5(HybridDecoder, Configurable):
    @dataclass(kw_only=True)
    class Config(HybridDecoderConfig, Configurable.Config):
        """Qwen3.5 shapes (fields documented on HybridDecoderConfig and DecoderConfig); named
        sizes are in sizes.py."""

        @property
        def num_params(self) -> int:
            """Parameter count (tied embeddings counted once)."""
            blocks = self.mixer_params() + self.num_layers * 3 * self.dim * self.ffn_dim
            embeddings = self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)
            return blocks + embeddings + self.dim

    def __init__(self, config: Config) -> None:
        super().__init__(config, qk_norm=True)
