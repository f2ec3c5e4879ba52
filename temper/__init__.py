"""Temper: PyTorch-native RL post-training with a Tinker-style API."""

from temper.api.client import ServiceClient, TrainingClient
from temper.api.sampling_client import SamplingClient
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
