"""Parallelize a Llama 3 model: the dense decoder plan (temper/models/common/parallelize.py);
Llama has no q/k norms, so TP splits only the projections."""

from temper.models.common.parallelize import parallelize_decoder as parallelize_llama

__all__ = ["parallelize_llama"]
