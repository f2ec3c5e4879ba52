"""A generator rank whose device fails (a sticky CUDA error, faked on CPU) ends with that
reason: the failing call and every later one say so, instead of answering on."""

from __future__ import annotations

import threading

import torch

from temper.generator.generator_rank import GeneratorRank
from temper.generator.remote import Answer, Failure, GenerateCall


class _FailingDevice:
    version = 0

    def __init__(self) -> None:
        self.calls = 0

    def generate(self, requests):
        self.calls += 1
        if self.calls == 2:
            raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")
        return ["ok"]


def _rank(engine) -> GeneratorRank:
    """A rank past its start-up (the engine built, version 0), without process groups."""
    rank = GeneratorRank.__new__(GeneratorRank)
    rank._changed = threading.Condition()
    rank._engine, rank._version, rank._ended = engine, 0, None
    return rank


def test_a_device_error_ends_the_rank_with_its_reason():
    engine = _FailingDevice()
    rank = _rank(engine)
    call = GenerateCall(version=0, requests=[])
    assert isinstance(rank._answer(call), Answer)
    failed = rank._answer(call)
    assert isinstance(failed, Failure)
    assert "its device failed (AcceleratorError: CUDA error: an illegal memory" in failed.message
    later = rank._answer(call)
    assert isinstance(later, Failure) and "serves no more" in later.message
    assert engine.calls == 2  # nothing ran on the broken device after the error
