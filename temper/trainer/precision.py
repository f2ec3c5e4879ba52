"""Precision: the dtype a trainer keeps its weights in and the dtype it computes in.

Three choices, and 'auto' picking one by device:

- 'float32': weights, gradients, AdamW moments and every matmul in fp32 (on CUDA jobs the
  matmuls take TF32 tensor cores, job/model.py). What CPU runs use: CPU results stay bitwise
  what they are without any precision machinery.
- 'bf16-mixed': fp32 master weights, gradients and AdamW moments; forward and backward
  matmuls in bf16. Weights that never change (a LoRA base) need no master copy: they are
  kept in bf16, and only the adapters in fp32. Unsharded, the trainer runs its forward and
  loss under `torch.autocast`; sharded, FSDP2 gathers bf16 copies of the shards and reduces
  gradients in fp32 (`MixedPrecisionPolicy`), autocast on top. The generator decodes a bf16
  copy, refreshed by a cast at each weight sync (client/weight_sync.py). The GPU default.
- 'bfloat16': everything in bf16, no master copy (half the memory of the weights and optimizer
  state). An AdamW update moves a weight by about the learning rate, and bf16 keeps 8 bits of
  mantissa: an update below half a bf16 spacing of the weight (2^-9 of it) rounds away, so
  lr 1e-5 leaves 0.02-scale weights unchanged.

The generator decodes in the compute dtype (`Precision.compute`), so its logprobs are those of
the bf16 policy it samples from; the trainer's logprobs come from its own (autocast) forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import nn

PrecisionName = Literal["auto", "float32", "bf16-mixed", "bfloat16"]
"""A precision as a config names it; 'auto' is 'bf16-mixed' on CUDA and 'float32' elsewhere."""

_DTYPES: dict[str, tuple[str, str]] = {
    # name: (parameter dtype, compute dtype)
    "float32": ("float32", "float32"),
    "bf16-mixed": ("float32", "bfloat16"),
    "bfloat16": ("bfloat16", "bfloat16"),
}


@dataclass(frozen=True)
class Precision:
    """A resolved precision (never 'auto')."""

    name: Literal["float32", "bf16-mixed", "bfloat16"]

    @classmethod
    def resolve(cls, name: str, *, device: str | torch.device, field: str = "dtype") -> Precision:
        """`name` on `device`: 'auto' is 'bf16-mixed' on CUDA and 'float32' elsewhere (CPU
        results stay what they are in fp32). `field` names the setting in errors."""
        if name not in get_args(PrecisionName):
            raise ValueError(
                f"{field} must be one of {', '.join(get_args(PrecisionName))}, got {name!r}"
            )
        if name == "auto":
            name = "bf16-mixed" if torch.device(device).type == "cuda" else "float32"
        return cls(name)

    @property
    def parameters(self) -> str:
        """The dtype of the trainer's trained weights, their gradients and AdamW moments."""
        return _DTYPES[self.name][0]

    def base(self, *, lora: bool) -> str:
        """The dtype a trainer's model is loaded in: a LoRA base, which never changes, in the
        compute dtype (no master copy needed); a fully trained model in `parameters`."""
        return self.compute if lora else self.parameters

    @property
    def compute(self) -> str:
        """The dtype matmuls run in, and the generator's weights and KV cache."""
        return _DTYPES[self.name][1]

    @property
    def mixed(self) -> bool:
        """Whether the trainer computes in another dtype than it keeps its weights in."""
        return self.parameters != self.compute


@contextlib.contextmanager
def compute_in(device: torch.device, dtype: torch.dtype | None) -> Iterator[None]:
    """Autocast to `dtype` on `device` (None: no autocast, ops run in their inputs' dtypes).
    Autocast state is per thread: enter it on the thread that runs the forward."""
    if dtype is None:
        yield
        return
    with torch.autocast(device.type, dtype=dtype):
        yield


@torch.no_grad()
def keep_trained_in_fp32(model: nn.Module) -> None:
    """The master weights of mixed precision: every trained parameter in fp32 (LoRA adapters
    made in their bf16 base's dtype are cast; frozen weights stay as they are)."""
    for parameter in model.parameters():
        if parameter.requires_grad and parameter.dtype != torch.float32:
            parameter.data = parameter.data.float()
