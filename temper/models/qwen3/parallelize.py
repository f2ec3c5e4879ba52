"""Parallelize a Qwen3 model: the dense decoder plan (temper/models/common/parallelize.py)."""

from temper.models.common.parallelize import parallelize_decoder as parallelize_qwen3

__all__ = ["parallelize_qwen3"]
