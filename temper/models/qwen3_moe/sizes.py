"""Named Qwen3-MoE sizes: `tiny` for tests and the demo, and the published MoE checkpoints.

The published shapes are those of Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B (vocab 151936,
4 KV heads of 128, 128 experts with 8 per token and renormalized top-k weights, every layer
sparse, rope_theta 1e6, 40960 positions). `tiny` is the dense families' tiny shape with 8
experts of width 128, 2 per token, in every layer; it takes its vocabulary from the tokenizer
it is paired with.
"""

from __future__ import annotations

from types import MappingProxyType

from temper.models.common.sizes import TINY_SHAPE, named_size
from temper.models.qwen3.sizes import QWEN3_VOCAB_SIZE
from temper.models.qwen3_moe.model import Qwen3Moe


def _published(
    *, dim: int, num_layers: int, num_heads: int, ffn_dim: int, moe_ffn_dim: int
) -> Qwen3Moe.Config:
    return Qwen3Moe.Config(
        vocab_size=QWEN3_VOCAB_SIZE,
        dim=dim,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=4,
        head_dim=128,
        ffn_dim=ffn_dim,
        num_experts=128,
        top_k=8,
        moe_ffn_dim=moe_ffn_dim,
    )


QWEN3_MOE_SIZES = MappingProxyType(
    {
        "tiny": Qwen3Moe.Config(
            vocab_size=QWEN3_VOCAB_SIZE, **TINY_SHAPE, num_experts=8, top_k=2, moe_ffn_dim=128
        ),
        "30B-A3B": _published(dim=2048, num_layers=48, num_heads=32, ffn_dim=6144, moe_ffn_dim=768),
        "235B-A22B": _published(
            dim=4096, num_layers=94, num_heads=64, ffn_dim=12288, moe_ffn_dim=1536
        ),
    }
)


def qwen3_moe_size(name: str, *, vocab_size: int | None = None) -> Qwen3Moe.Config:
    """A fresh config for a named size, optionally with another vocabulary size."""
    return named_size(QWEN3_MOE_SIZES, name, family="Qwen3-MoE", vocab_size=vocab_size)
