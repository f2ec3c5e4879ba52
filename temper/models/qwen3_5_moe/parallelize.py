"""Parallelize a Qwen3.5-MoE model: Qwen3.5's plan (heads of both token mixers split over TP);
expert parallelism, activation checkpointing, compile and FSDP2 from the decoder plan. The
routed experts and the shared expert stay whole on every tp rank."""

from temper.models.qwen3_5.parallelize import parallelize_qwen3_5 as parallelize_qwen3_5_moe

__all__ = ["parallelize_qwen3_5_moe"]
