"""Llama 3 dense models."""

from temper.models.llama.model import Llama
from temper.models.llama.sizes import LLAMA_SIZES, llama_size

__all__ = ["LLAMA_SIZES", "Llama", "llama_size"]
