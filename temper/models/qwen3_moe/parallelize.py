"""Parallelize a Qwen3-MoE model: the decoder plan (temper/models/common/parallelize.py), which
splits attention and dense layers over TP and keeps routed experts whole on every TP rank."""

from temper.models.common.parallelize import parallelize_decoder as parallelize_qwen3_moe

__all__ = ["parallelize_qwen3_moe"]
