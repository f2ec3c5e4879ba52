"""Process counts from the cores a call could have had (`cpu.processes='auto'`): the
measurement's arithmetic, and a hybrid model's calls staying in one process or splitting as
it says, with the tokens of one process either way."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from temper.api import SamplingParams
from temper.models import materialize
from temper.models.qwen3_5 import qwen3_5_size
from temper.sampler.cpu.core_share import CoreShare, CpuTimes, cores_had, read_cpu_times
from temper.sampler.cpu.decoding import CpuDecoding
from temper.sampler.cpu.process_split import ProcessSplitSampler
from temper.sampler.engine import SamplerEngine, SampleRequest


def test_cores_had_counts_own_and_helper_time_and_idle_time():
    start = CpuTimes(wall_s=10.0, idle_s=100.0, own_s=5.0, helpers_s={7: 1.0})
    end = CpuTimes(wall_s=12.0, idle_s=101.0, own_s=7.0, helpers_s={7: 2.5, 8: 0.5})
    # own 2 s + helper 7 1.5 s + helper 8 (new) 0.5 s + idle 1 s, over 2 s of wall time
    assert cores_had(start, end) == pytest.approx(2.5)
    assert cores_had(end, end) is None


def test_processes_round_the_measured_cores_within_bounds():
    share = CoreShare()
    assert share.processes(at_most=3) == 3  # nothing measured yet: as configured
    for cores, expected in ((0.4, 1), (1.4, 1), (1.6, 2), (7.0, 3)):
        share.cores = cores
        assert share.processes(at_most=3) == expected


def test_a_measured_block_reads_this_process():
    if read_cpu_times([]) is None:
        pytest.skip("no /proc here")
    share = CoreShare()
    with share.measure(lambda: []):
        torch.randn(256, 256) @ torch.randn(256, 256)
    assert share.cores is not None and share.cores >= 0


@pytest.fixture(scope="module")
def model():
    config = dataclasses.replace(qwen3_5_size("tiny", vocab_size=31), init_std=0.1)
    return materialize(config, seed=5, dtype="float32").eval()


def _engine(model, processes):
    cpu = CpuDecoding.Config(processes=processes, process_min_rows=4, num_threads=1)
    return SamplerEngine.Config(max_batch=8, max_seq_len=32, cpu=cpu).build(model=model)


def test_auto_processes_follow_the_measured_cores_on_a_hybrid_model(model):
    split = _engine(model, "auto")
    if not isinstance(split, ProcessSplitSampler):
        pytest.skip("one core: 'auto' never splits")
    single = _engine(model, 1)
    requests = [
        SampleRequest(prompt=[3 + i, 4, 5], params=SamplingParams(max_tokens=6, seed=i))
        for i in range(8)
    ]
    expected = single.generate(requests)
    try:
        split.core_share.cores = 1.2  # other work holds the rest: one process
        got = split.generate(requests)
        assert split.helpers.num_running == 0
        for a, b in zip(got, expected, strict=True):
            assert a.sequences[0].tokens == b.sequences[0].tokens
            assert a.sequences[0].logprobs == b.sequences[0].logprobs
        split.core_share.cores = 2.0  # a core free: the call splits, the same tokens
        got = split.generate(requests)
        assert split.helpers.num_running == 1
        for a, b in zip(got, expected, strict=True):
            assert a.sequences[0].tokens == b.sequences[0].tokens
            torch.testing.assert_close(
                torch.tensor(a.sequences[0].logprobs),
                torch.tensor(b.sequences[0].logprobs),
                rtol=0,
                atol=1e-5,
            )
        assert split.core_share.cores is not None  # measured again
    finally:
        split.close()
