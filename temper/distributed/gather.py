"""Whole tensors from a sharded model, for each rank's sampler copy and for export.

`DTensor.full_tensor()` all-gathers the shards (FSDP over dp, TP over tp) into the exact
values a single-process model would hold: nothing is recomputed, so the result is bitwise the
unsharded tensor. Collective: every rank calls it and every rank gets the whole tensors.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor


@torch.no_grad()
def full_state_dict(
    model: nn.Module, *, keep: Callable[[str], bool] | None = None
) -> dict[str, torch.Tensor]:
    """`model.state_dict()` with every DTensor gathered whole (only keys `keep` accepts)."""
    return {
        key: value.full_tensor() if isinstance(value, DTensor) else value.detach()
        for key, value in model.state_dict().items()
        if keep is None or keep(key)
    }
