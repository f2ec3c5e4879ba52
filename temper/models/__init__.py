"""Model library: shared layers, model families, meta-device construction."""

from temper.models.build import materialize
from temper.models.qwen3 import QWEN3_SIZES, Qwen3, qwen3_size

__all__ = ["QWEN3_SIZES", "Qwen3", "materialize", "qwen3_size"]
