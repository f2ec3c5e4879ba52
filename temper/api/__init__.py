"""The Tinker-style API: domain types (clients come with the trainer)."""

from temper.api.types import (
    AdamParams,
    Datum,
    EncodedTextChunk,
    ForwardBackwardOutput,
    LoadWeightsResponse,
    ModelInput,
    OptimStepResponse,
    SampledSequence,
    SampleResponse,
    SamplingParams,
    SaveWeightsResponse,
    TensorData,
)

__all__ = [
    "AdamParams",
    "Datum",
    "EncodedTextChunk",
    "ForwardBackwardOutput",
    "LoadWeightsResponse",
    "ModelInput",
    "OptimStepResponse",
    "SampleResponse",
    "SampledSequence",
    "SamplingParams",
    "SaveWeightsResponse",
    "TensorData",
]
