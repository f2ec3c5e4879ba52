"""Sampling. For now only the reference greedy decoder; the KV-cache engine comes next."""

from temper.sampler.reference import greedy_decode

__all__ = ["greedy_decode"]
