"""Build a model on the meta device and materialize it once on its target device.

Constructing a large model normally allocates and initializes every weight on the CPU before
it is moved or overwritten by a checkpoint. Here the module is created on `meta` (no memory),
cast there (free), given uninitialized storage on the target device with `to_empty`, and then
either randomly initialized in place or filled from a checkpoint. Each weight is allocated once.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import nn

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str | torch.dtype, *, field: str = "dtype") -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"{field} must be one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def materialize(
    config: Any,
    *,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = torch.float32,
    init: Literal["random", "empty"] = "random",
    seed: int = 0,
) -> nn.Module:
    """Build `config` (a model Config) on `device` in `dtype`.

    init='random' draws the weights from a generator seeded with `seed` (same seed, same
    weights); init='empty' leaves storage uninitialized for a checkpoint loader to fill.
    """
    if init not in ("random", "empty"):
        raise ValueError(f"init must be 'random' or 'empty', got {init!r}")
    device = torch.device(device)
    with torch.device("meta"):
        model = config.build()
    model = model.to(dtype=parse_dtype(dtype)).to_empty(device=device)
    if init == "random":
        generator = torch.Generator(device=device).manual_seed(seed)
        model.init_weights(generator=generator)
    return model
