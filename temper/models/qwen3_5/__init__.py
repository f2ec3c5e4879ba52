"""Qwen3.5 dense models (hybrid Gated DeltaNet and gated full attention)."""

from temper.models.qwen3_5.model import Qwen3_5
from temper.models.qwen3_5.sizes import QWEN3_5_SIZES, qwen3_5_size

__all__ = ["QWEN3_5_SIZES", "Qwen3_5", "qwen3_5_size"]
