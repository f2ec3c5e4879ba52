"""Qwen3-MoE models."""

from temper.models.qwen3_moe.model import Qwen3Moe
from temper.models.qwen3_moe.sizes import QWEN3_MOE_SIZES, qwen3_moe_size

__all__ = ["QWEN3_MOE_SIZES", "Qwen3Moe", "qwen3_moe_size"]
