"""Zero-filled cache memory that costs only what is touched (the KV cache, the recurrent-state
pool, route records).

On CPU the zeros are the kernel's: pages of an anonymous mapping, zero-filled when first
touched, so building an engine costs what its requests will touch, not a memset of the whole
cache (a server builds one per sampling snapshot; the tiny model's 512 MiB cache took 0.4 s to
zero).
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Sequence

import torch


def zeros(dims: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`torch.zeros(dims)`; on CPU in pages the kernel zero-fills on first touch (an
    anonymous mapping, freed with the tensor), so untouched positions cost nothing."""
    numel = math.prod(dims)
    if torch.device(device).type != "cpu" or numel == 0:
        return torch.zeros(dims, dtype=dtype, device=device)
    buffer = mmap.mmap(-1, numel * torch.empty((), dtype=dtype).element_size())
    return torch.frombuffer(buffer, dtype=dtype, count=numel).view(*dims)
