"""Sampling: the KV-cache engine, and a slow oracle greedy decoder the tests check it against."""

from temper.sampler.engine import SamplerEngine
from temper.sampler.oracle import greedy_decode
from temper.sampler.requests import SampleRequest

__all__ = ["SampleRequest", "SamplerEngine", "greedy_decode"]
