"""Temper: PyTorch-native RL post-training with a Tinker-style API."""

from temper.api.client import SamplingClient, ServiceClient, TrainingClient
from temper.api.types import AdamParams, Datum, ModelInput, SamplingParams, TensorData

__version__ = "0.1.0"

__all__ = [
    "AdamParams",
    "Datum",
    "ModelInput",
    "SamplingClient",
    "SamplingParams",
    "ServiceClient",
    "TensorData",
    "TrainingClient",
]
