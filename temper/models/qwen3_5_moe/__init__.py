"""Qwen3.5-MoE models (hybrid attention, routed plus shared experts)."""

from temper.models.qwen3_5_moe.model import Qwen3_5Moe
from temper.models.qwen3_5_moe.sizes import QWEN3_5_MOE_SIZES, qwen3_5_moe_size

__all__ = ["QWEN3_5_MOE_SIZES", "Qwen3_5Moe", "qwen3_5_moe_size"]
