"""Named Qwen3.5-MoE sizes: `tiny` for tests and the demo, and the published MoE checkpoints.

The published shapes are the text towers of Qwen/Qwen3.5-35B-A3B (2048 wide, 40 layers, 16
attention heads and 2 KV heads of 256, 256 experts of 512 with 8 per token, a shared expert of
512, Gated DeltaNet value heads 32) and Qwen/Qwen3.5-397B-A17B (4096 wide, 60 layers, 32 and 2
heads of 256, 512 experts of 1024 with 10 per token, a shared expert of 1024, value heads 64),
both with vocab 248320, untied embeddings, rope_theta 1e7, every fourth layer full attention.
The values were read from copies of the released config.json files (the hub itself was not
reachable from here).

`tiny` is Qwen3.5's tiny shape with 8 experts of width 64, 2 per token, and a shared expert of
width 128; it takes its vocabulary from the tokenizer it is paired with.
"""

from __future__ import annotations

from types import MappingProxyType

from temper.models.common.sizes import TINY_SHAPE, named_size
from temper.models.qwen3_5.sizes import PUBLISHED_SHAPE, QWEN3_5_VOCAB_SIZE, TINY_LINEAR_SHAPE
from temper.models.qwen3_5_moe.model import Qwen3_5Moe


def _published(
    *,
    dim: int,
    num_layers: int,
    num_heads: int,
    num_experts: int,
    top_k: int,
    moe_ffn_dim: int,
    linear_value_heads: int,
) -> Qwen3_5Moe.Config:
    return Qwen3_5Moe.Config(
        **PUBLISHED_SHAPE,
        dim=dim,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=2,
        ffn_dim=moe_ffn_dim,  # the shared expert's width, equal to each routed expert's
        num_experts=num_experts,
        top_k=top_k,
        moe_ffn_dim=moe_ffn_dim,
        linear_num_value_heads=linear_value_heads,
    )


QWEN3_5_MOE_SIZES = MappingProxyType(
    {
        "tiny": Qwen3_5Moe.Config(
            vocab_size=QWEN3_5_VOCAB_SIZE,
            **{**TINY_SHAPE, "ffn_dim": 128},
            **TINY_LINEAR_SHAPE,
            num_experts=8,
            top_k=2,
            moe_ffn_dim=64,
        ),
        "35B-A3B": _published(
            dim=2048,
            num_layers=40,
            num_heads=16,
            num_experts=256,
            top_k=8,
            moe_ffn_dim=512,
            linear_value_heads=32,
        ),
        "397B-A17B": _published(
            dim=4096,
            num_layers=60,
            num_heads=32,
            num_experts=512,
            top_k=10,
            moe_ffn_dim=1024,
            linear_value_heads=64,
        ),
    }
)


def qwen3_5_moe_size(name: str, *, vocab_size: int | None = None) -> Qwen3_5Moe.Config:
    """A fresh config for a named size, optionally with another vocabulary size."""
    return named_size(QWEN3_5_MOE_SIZES, name, family="Qwen3.5-MoE", vocab_size=vocab_size)
