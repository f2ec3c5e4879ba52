"""Sampling: the KV-cache engine, and a slow reference greedy decoder used as a test oracle."""

from temper.sampler.engine import SamplerEngine
from temper.sampler.reference import greedy_decode
from temper.sampler.requests import SampleRequest

__all__ = ["SampleRequest", "SamplerEngine", "greedy_decode"]
