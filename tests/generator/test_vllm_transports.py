"""Which transport new weights take into vLLM (generator/vllm_transports.py), for every
placement, with no vLLM or GPU needed: the rule, and the refusal of a forced choice that
cannot work there."""

from __future__ import annotations

import pytest
import torch

from temper.generator.vllm import VllmGenerator
from temper.generator.vllm_transports import choose_transport, worker_devices

CPU = torch.device("cpu")
GPU0, GPU1, GPU2 = (torch.device("cuda", index) for index in range(3))


@pytest.mark.parametrize(
    ("in_process", "sender", "workers", "expected"),
    [
        (True, CPU, [CPU], "inline"),
        (True, GPU0, [GPU0], "inline"),
        (False, CPU, [CPU], "ipc"),  # vLLM's engine process on CPU: host memory is shared
        (False, CPU, [CPU, CPU], "ipc"),  # tensor-parallel workers on CPU
        (False, GPU0, [GPU0], "ipc"),  # colocated on one GPU
        (False, GPU0, [GPU1], "nccl"),  # vLLM on another GPU
        (False, GPU0, [GPU1, GPU2], "nccl"),
        (False, GPU0, [GPU0, GPU1], "gloo"),  # one worker on the sender's GPU
        (False, CPU, [GPU0], "gloo"),  # a sender on CPU
    ],
)
def test_auto_picks_the_transport_from_the_placement(in_process, sender, workers, expected):
    chosen = choose_transport("auto", in_process=in_process, sender=sender, workers=workers)
    assert chosen == expected


def test_a_forced_choice_is_taken_where_it_works():
    assert choose_transport("gloo", in_process=False, sender=CPU, workers=[CPU]) == "gloo"
    assert choose_transport("gloo", in_process=False, sender=GPU0, workers=[GPU1]) == "gloo"
    assert choose_transport("ipc", in_process=False, sender=GPU1, workers=[GPU1]) == "ipc"
    assert choose_transport("nccl", in_process=False, sender=GPU0, workers=[GPU1]) == "nccl"


@pytest.mark.parametrize(
    ("choice", "in_process", "sender", "workers", "message"),
    [
        ("nccl", False, CPU, [CPU], r"'nccl' needs the sender and every vLLM worker"),
        ("nccl", False, GPU0, [GPU0], r"cannot pair two ranks on one GPU.*use 'ipc'"),
        ("ipc", False, GPU0, [GPU1], r"'ipc' shares memory on one device.*'nccl'"),
        ("ipc", True, CPU, [CPU], r"needs vLLM in its own processes.*engine_process='separate'"),
        ("gloo", True, CPU, [CPU], r"needs vLLM in its own processes"),
        ("inline", False, CPU, [CPU], r"'inline' needs vLLM in this process.*'ipc'"),
    ],
)
def test_a_forced_choice_that_cannot_work_is_refused_saying_why(
    choice, in_process, sender, workers, message
):
    with pytest.raises(ValueError, match=r"VllmGenerator\.Config\.transport=.*" + message):
        choose_transport(choice, in_process=in_process, sender=sender, workers=workers)


def test_vllms_workers_take_the_visible_gpus_in_order():
    assert worker_devices(sender=CPU, tensor_parallel_size=2) == [CPU, CPU]
    assert worker_devices(sender=GPU1, tensor_parallel_size=2) == [GPU0, GPU1]


def test_the_config_field_names_the_valid_transports():
    with pytest.raises(ValueError, match=r"VllmGenerator\.Config\.transport must be .*'ipc'"):
        VllmGenerator.Config(transport="shm")


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(transport="ipc"), r"transport='ipc' needs vLLM in its own processes"),
        (dict(transport="nccl"), r"transport='nccl' needs vLLM in its own processes"),
        (dict(transport="inline", engine_process="separate"), r"'inline' needs vLLM in this"),
        (dict(transport="inline", tensor_parallel_size=2), r"'inline' needs vLLM in this"),
    ],
    ids=["ipc-inline", "nccl-inline", "inline-separate", "inline-tp2"],
)
def test_a_transport_across_the_wrong_process_boundary_is_refused_by_the_config(settings, message):
    """Before any engine (or a job's warm-up) starts."""
    with pytest.raises(ValueError, match=message):
        VllmGenerator.Config(**settings)
