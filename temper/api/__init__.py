"""The Tinker-style API: domain types (clients come with the trainer)."""

from temper.api.types import SampledSequence, SampleResponse, SamplingParams

__all__ = ["SampleResponse", "SampledSequence", "SamplingParams"]
