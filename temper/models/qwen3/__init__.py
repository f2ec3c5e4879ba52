"""Qwen3 dense models."""

from temper.models.qwen3.model import Qwen3
from temper.models.qwen3.sizes import QWEN3_SIZES, qwen3_size

__all__ = ["QWEN3_SIZES", "Qwen3", "qwen3_size"]
