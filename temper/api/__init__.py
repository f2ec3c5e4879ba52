"""The Tinker contract: domain types, backend Protocols of the verbs, futures.

The in-process clients that implement it live in `temper.client`.
"""

from temper.api.prompt_targets import PromptTargetLogprobs, PromptTargets
from temper.api.types import (
    AdamParams,
    Datum,
    EncodedTextChunk,
    ForwardBackwardOutput,
    ImageAssetPointerChunk,
    ImageChunk,
    LoadWeightsResponse,
    ModelInput,
    OptimStepResponse,
    RoutedExperts,
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
    "ImageAssetPointerChunk",
    "ImageChunk",
    "LoadWeightsResponse",
    "ModelInput",
    "OptimStepResponse",
    "PromptTargetLogprobs",
    "PromptTargets",
    "RoutedExperts",
    "SampleResponse",
    "SampledSequence",
    "SamplingParams",
    "SaveWeightsResponse",
    "TensorData",
]
