"""Temper: PyTorch-native RL post-training with a Tinker-style API.

The public names load on first use, so `import temper.cli` (the `temper` command) can set its
process's OpenMP settings before anything imports torch (see temper/__main__.py).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "AdamParams": "temper.api.types",
    "Datum": "temper.api.types",
    "ModelInput": "temper.api.types",
    "SamplingParams": "temper.api.types",
    "TensorData": "temper.api.types",
    "SamplingClient": "temper.client.sampling_client",
    "ServiceClient": "temper.client.service_client",
    "TrainingClient": "temper.client.training_client",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'temper' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
