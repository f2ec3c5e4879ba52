"""Temper: PyTorch-native RL post-training with a Tinker-style API."""

from temper.api.types import AdamParams, Datum, ModelInput, SamplingParams, TensorData
from temper.client.sampling_client import SamplingClient
from temper.client.service_client import ServiceClient
from temper.client.training_client import TrainingClient

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
