"""Model library: shared layers, model families, meta-device construction."""

from temper.models.build import materialize
from temper.models.llama import LLAMA_SIZES, Llama, llama_size
from temper.models.qwen3 import QWEN3_SIZES, Qwen3, qwen3_size
from temper.models.qwen3_moe import QWEN3_MOE_SIZES, Qwen3Moe, qwen3_moe_size

__all__ = [
    "LLAMA_SIZES",
    "QWEN3_MOE_SIZES",
    "QWEN3_SIZES",
    "Llama",
    "Qwen3",
    "Qwen3Moe",
    "llama_size",
    "materialize",
    "qwen3_moe_size",
    "qwen3_size",
]
