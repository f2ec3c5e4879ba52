"""Parallelize a Qwen3.5 model: the decoder plan (temper/models/common/parallelize.py), whose
tensor-parallel split of hybrid blocks (heads of the gated attention and of the Gated
DeltaNet) is temper/models/common/hybrid_parallel.py."""

from temper.models.common.parallelize import parallelize_decoder as parallelize_qwen3_5

__all__ = ["parallelize_qwen3_5"]
