"""Gradients a failed call must not touch: set aside for the call, added back on success."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class GradientStash:
    """Set accumulated gradients aside for one call; add the call's to them on success,
    restore them untouched on failure."""

    def __init__(self, parameters: list[nn.Parameter]) -> None:
        self.parameters = parameters
        self.saved: list[torch.Tensor | None] = []

    def __enter__(self) -> GradientStash:
        self.saved = [p.grad for p in self.parameters]
        for parameter in self.parameters:
            parameter.grad = None
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        for parameter, saved in zip(self.parameters, self.saved, strict=True):
            if exc_type is not None:
                parameter.grad = saved
            elif saved is not None:
                if parameter.grad is not None:
                    saved.add_(parameter.grad)
                parameter.grad = saved
