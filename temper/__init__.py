"""Temper: PyTorch-native RL post-training with a Tinker-style API."""

from temper.api.types import AdamParams, Datum, ModelInput, SamplingParams, TensorData
from temper.client.sampling_client import SamplingClient
from temper.client.training_client import ServiceClient, TrainingClient

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
