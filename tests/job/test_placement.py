"""Which GPUs a vLLM generator rank's engine processes may see (CUDA_VISIBLE_DEVICES, set
before vLLM starts them), checked without a GPU."""

from __future__ import annotations

import os

import pytest

from temper.job.placement import lend_group_devices


@pytest.mark.parametrize(
    ("visible", "local_rank", "tp", "expected"),
    [
        (None, "0", 1, "0"),
        (None, "3", 1, "3"),  # tp 1 too: not every GPU, whose first is a trainer's
        (None, "2", 2, "2,3"),
        ("4,5,6,7", "1", 1, "5"),  # the launcher's own selection is respected
        ("4,5,6,7", "2", 2, "6,7"),
    ],
)
def test_a_generator_rank_lends_its_own_gpus(monkeypatch, visible, local_rank, tp, expected):
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    lend_group_devices(tp)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == expected


def test_a_group_past_the_node_is_refused(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="generator_tp=2: the engine of local rank 3"):
        lend_group_devices(2)
