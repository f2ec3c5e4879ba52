"""Qwen3 dense decoder: GQA with per-head q/k RMSNorm, RoPE, SwiGLU, optionally tied embeddings.

Single-device code. Sharding, compile and the like are applied from outside (parallelize.py);
HF naming lives only in state_dict_adapter.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from temper.config.configurable import Configurable
from temper.models.common.decoder import ActivationCheckpointing, Decoder


class Qwen3(Decoder, Configurable):
    @dataclass(kw_only=True)
    class Config(Configurable.Config):
        vocab_size: int
        """Number of token ids the embedding and output layers cover."""
        dim: int
        """Model (hidden) width."""
        num_layers: int
        """Number of decoder blocks."""
        num_heads: int
        """Attention query heads."""
        num_kv_heads: int
        """Key/value heads (grouped-query attention); must divide num_heads."""
        head_dim: int
        """Width of each attention head (Qwen3 uses 128, independent of dim)."""
        ffn_dim: int
        """Hidden width of the SwiGLU feed-forward."""
        rope_theta: float = 1_000_000.0
        """RoPE base frequency."""
        norm_eps: float = 1e-6
        """Epsilon of every RMSNorm."""
        tie_embeddings: bool = False
        """Share the input embedding with the output projection."""
        attention_bias: bool = False
        """Biases on the q/k/v/o projections (False in published Qwen3 checkpoints)."""
        max_seq_len: int = 40_960
        """Longest sequence (prompt + completion) the model is used with."""
        init_std: float = 0.02
        """Standard deviation of the random normal init of weight matrices."""
        activation_checkpointing: ActivationCheckpointing = "none"
        """'full' recomputes each block's activations in backward to save memory."""

        def __post_init__(self) -> None:
            positive = ("vocab_size", "dim", "num_layers", "num_heads", "num_kv_heads")
            positive += ("head_dim", "ffn_dim", "max_seq_len")
            for name in positive:
                value = getattr(self, name)
                if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                    raise ValueError(f"Qwen3.Config.{name} must be a positive int, got {value!r}")
            if self.num_heads % self.num_kv_heads != 0:
                raise ValueError(
                    f"Qwen3.Config.num_kv_heads={self.num_kv_heads} must divide "
                    f"num_heads={self.num_heads}"
                )
            if self.head_dim % 2 != 0:
                raise ValueError(
                    f"Qwen3.Config.head_dim must be even for RoPE, got {self.head_dim}"
                )
            if self.activation_checkpointing not in ("none", "full"):
                raise ValueError(
                    "Qwen3.Config.activation_checkpointing must be 'none' or 'full', got "
                    f"{self.activation_checkpointing!r}"
                )

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
        super().__init__(
            vocab_size=config.vocab_size,
            dim=config.dim,
            num_layers=config.num_layers,
            ffn_dim=config.ffn_dim,
            num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            qk_norm=True,
            attention_bias=config.attention_bias,
            norm_eps=config.norm_eps,
            rope_theta=config.rope_theta,
            tie_embeddings=config.tie_embeddings,
            init_std=config.init_std,
            activation_checkpointing=config.activation_checkpointing,
        )
        self.config = config
