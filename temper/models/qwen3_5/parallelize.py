"""Parallelize a Qwen3.5 model: activation checkpointing, compile and FSDP2 through the decoder
plan (temper/models/common/parallelize.py). Its tensor-parallel plan covers GQA blocks only,
so tp > 1 is refused here for the hybrid blocks."""

from __future__ import annotations

from typing import Any

from torch import nn

from temper.distributed.parallel_dims import ParallelDims
from temper.models.common.parallelize import parallelize_decoder


def parallelize_qwen3_5(
    model: nn.Module, *, parallel_dims: ParallelDims, **kwargs: Any
) -> nn.Module:
    if parallel_dims.tp_enabled:
        raise ValueError(
            f"ParallelDims.Config.tp={parallel_dims.tp} is not supported for Qwen3.5 (hybrid "
            "Gated DeltaNet blocks have no tensor-parallel plan); use tp=1"
        )
    return parallelize_decoder(model, parallel_dims=parallel_dims, **kwargs)
