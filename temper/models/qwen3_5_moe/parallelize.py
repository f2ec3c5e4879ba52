"""Parallelize a Qwen3.5-MoE model: Qwen3.5's plan (no tensor parallelism for the hybrid
blocks); expert parallelism, activation checkpointing, compile and FSDP2 from the decoder
plan."""

from temper.models.qwen3_5.parallelize import parallelize_qwen3_5 as parallelize_qwen3_5_moe

__all__ = ["parallelize_qwen3_5_moe"]
