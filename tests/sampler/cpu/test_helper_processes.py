"""Generate calls split over helper processes (`cpu.processes`, a `ProcessSplitSampler` around
the engine): the same responses as one process (dense and MoE models), weights that follow
the trainer's updates through shared memory, bad input, a helper that dies, and how requests
are split."""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import subprocess
import sys
import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from temper.api import SamplingParams
from temper.models import materialize, qwen3_moe_size, qwen3_size
from temper.sampler.cpu import helper_processes
from temper.sampler.cpu.decoding import CpuDecoding
from temper.sampler.cpu.helper_processes import HelperProcesses, _balanced_ranges
from temper.sampler.cpu.process_split import ProcessSplitSampler
from temper.sampler.engine import SamplerEngine, SampleRequest
from temper.tokenizer import build_builtin_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_builtin_tokenizer("letters")


def _model(tokenizer, *, seed=3, size=qwen3_size):
    config = dataclasses.replace(size("tiny", vocab_size=tokenizer.vocab_size), init_std=0.1)
    return materialize(config, seed=seed).eval()


def _engine(model, tokenizer, **cpu):
    cpu = CpuDecoding.Config(**{"num_threads": 1, "process_min_rows": 4, "processes": 1, **cpu})
    config = SamplerEngine.Config(max_batch=16, max_seq_len=48, cpu=cpu)
    return config.build(model=model, tokenizer=tokenizer)


def _local(sampler):
    """The engine that decodes in this process (a split sampler's own)."""
    return sampler.engine if isinstance(sampler, ProcessSplitSampler) else sampler


def _requests(tokenizer, *, seed=0):
    """Prompts of different lengths; seeded and unseeded, greedy, top-k/top-p, stop strings,
    prompt and top-k logprobs: every per-request feature a helper must reproduce."""
    rng = random.Random(seed)
    requests = []
    for index in range(10):
        prompt = tokenizer.encode("".join(rng.choice("abcdefgh ") for _ in range(2 + index % 5)))
        params = SamplingParams(
            max_tokens=3 + index % 6,
            temperature=0.0 if index == 3 else 1.0,
            top_k=5 if index == 4 else -1,
            top_p=0.8 if index == 5 else 1.0,
            stop=["e", "ab"] if index % 3 == 0 else [],
            seed=None if index % 2 else 100 + index,
        )
        requests.append(
            SampleRequest(
                prompt=prompt,
                params=params,
                num_samples=1 + index % 4,
                prompt_logprobs=index == 6,
                topk_prompt_logprobs=2 if index == 6 else 0,
                topk_sample_logprobs=3 if index == 7 else 0,
            )
        )
    return requests


@pytest.fixture(scope="module")
def pair(tokenizer):
    """A one-process engine and a three-process engine on the same model."""
    model = _model(tokenizer)
    single = _engine(model, tokenizer)
    split = _engine(model, tokenizer, processes=3)
    assert isinstance(split, ProcessSplitSampler) and isinstance(single, SamplerEngine)
    yield model, single, split
    split.close()


def _generate_both(single, split, requests, *, entropy_seed):
    _local(single)._entropy.seed(entropy_seed)
    _local(split)._entropy.seed(entropy_seed)
    return single.generate(requests), split.generate(requests)


def _assert_same(got, expected):
    """The same tokens, stop reasons and top-k ids; logprobs equal up to float rounding (a
    part decodes in a smaller batch, like any other change of batch composition)."""

    def close(a, b):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)

    assert len(got) == len(expected)
    for response, reference in zip(got, expected, strict=True):
        for sequence, ref in zip(response.sequences, reference.sequences, strict=True):
            assert (sequence.tokens, sequence.stop_reason) == (ref.tokens, ref.stop_reason)
            close(sequence.logprobs, ref.logprobs)
            assert (sequence.topk_logprobs is None) == (ref.topk_logprobs is None)
            for top, top_ref in zip(
                sequence.topk_logprobs or [], ref.topk_logprobs or [], strict=True
            ):
                assert [i for i, _ in top] == [i for i, _ in top_ref]
                close([v for _, v in top], [v for _, v in top_ref])
        assert (response.prompt_logprobs is None) == (reference.prompt_logprobs is None)
        if reference.prompt_logprobs is not None:
            assert response.prompt_logprobs[0] is None
            close(response.prompt_logprobs[1:], reference.prompt_logprobs[1:])
            assert response.topk_prompt_logprobs[0] == reference.topk_prompt_logprobs[0]
            for top, top_ref in zip(
                response.topk_prompt_logprobs[1:], reference.topk_prompt_logprobs[1:], strict=True
            ):
                assert [i for i, _ in top] == [i for i, _ in top_ref]
                close([v for _, v in top], [v for _, v in top_ref])


def test_split_calls_return_what_one_process_returns(pair, tokenizer):
    _, single, split = pair
    requests = _requests(tokenizer)
    assert len(split.helpers.plan(requests)) == 3
    expected, got = _generate_both(single, split, requests, entropy_seed=1)
    assert split.helpers.num_running == 2
    _assert_same(got, expected)
    assert any(s.stop_reason == "stop" for r in got for s in r.sequences)
    # Unseeded requests draw fresh seeds per call, from the engine's entropy in request order.
    again, got_again = _generate_both(single, split, requests, entropy_seed=2)
    _assert_same(got_again, again)
    assert [r.sequences[0].tokens for r in again] != [r.sequences[0].tokens for r in expected]


def test_split_calls_on_a_moe_model_return_what_one_process_returns(tokenizer):
    """The experts' stacked weights reach the helpers through shared memory like any other,
    and an in-place update of them is followed."""
    model = _model(tokenizer, size=qwen3_moe_size)
    single, split = _engine(model, tokenizer), _engine(model, tokenizer, processes=2)
    try:
        requests = _requests(tokenizer, seed=2)
        expected, got = _generate_both(single, split, requests, entropy_seed=4)
        assert split.helpers.num_running == 1
        _assert_same(got, expected)
        with torch.no_grad():  # an optimizer step on the experts
            for block in model.blocks:
                block.feed_forward.experts.w_down.mul_(-1.0)
        for engine in (single, split):
            engine.update_weights(model, version=1)
        after, got_after = _generate_both(single, split, requests, entropy_seed=4)
        _assert_same(got_after, after)
        assert [r.sequences[0].tokens for r in after] != [r.sequences[0].tokens for r in expected]
    finally:
        split.close()


def test_helpers_follow_in_place_updates_and_new_modules(pair, tokenizer):
    model, single, split = pair
    requests = _requests(tokenizer, seed=1)
    before = _generate_both(single, split, requests, entropy_seed=3)[1]
    with torch.no_grad():  # an optimizer step: the helpers read these very tensors
        for parameter in model.parameters():
            parameter.add_(0.02 * torch.randn_like(parameter))
    for engine in (single, split):  # whoever writes the weights says so
        engine.update_weights(model, version=6)
    assert split.version == 6
    expected, got = _generate_both(single, split, requests, entropy_seed=3)
    _assert_same(got, expected)
    assert [r.sequences[0].tokens for r in got] != [r.sequences[0].tokens for r in before]

    other = _model(tokenizer, seed=4)  # new storage: sent to the helpers again
    for engine in (single, split):
        engine.update_weights(other, version=7)
    expected, got = _generate_both(single, split, requests, entropy_seed=3)
    _assert_same(got, expected)
    state = {name: 1.01 * value for name, value in model.state_dict().items()}
    for engine in (single, split):  # a state dict: copied into the engines' own modules
        engine.update_weights(state, version=8)
    expected, got = _generate_both(single, split, requests, entropy_seed=3)
    _assert_same(got, expected)
    for engine in (single, split):
        engine.update_weights(model, version=9)


def test_a_bad_request_fails_the_call_before_any_part_runs(pair, tokenizer):
    _, single, split = pair
    requests = _requests(tokenizer)
    bad = dataclasses.replace(requests[8], prompt=[1, tokenizer.vocab_size])
    with pytest.raises(ValueError, match="request 8: prompt token"):
        split.generate([*requests[:8], bad, *requests[9:]])
    assert split.engine.slots.num_active == 0
    expected, got = _generate_both(single, split, requests, entropy_seed=4)
    _assert_same(got, expected)


def _one_helper_running(tokenizer):
    """(one-process engine, two-process engine whose helper has started, requests, helper)."""
    model = _model(tokenizer)
    single, split = _engine(model, tokenizer), _engine(model, tokenizer, processes=2)
    requests = _requests(tokenizer)
    _generate_both(single, split, requests, entropy_seed=5)  # starts the helper
    (helper,) = split.helpers._helpers
    return single, split, requests, helper


def test_a_helper_that_dies_is_dropped_with_a_warning_and_its_part_runs_here(tokenizer):
    single, split, requests, helper = _one_helper_running(tokenizer)
    helper.process.kill()
    helper.process.wait()
    with pytest.warns(RuntimeWarning, match="helper process"):
        expected, got = _generate_both(single, split, requests, entropy_seed=6)
    _assert_same(got, expected)
    assert split.helpers.num_running == 0
    assert len(split.helpers.plan(requests)) == 1  # no more splitting


def test_weights_too_large_for_shared_memory_stay_here_with_a_warning(tokenizer, monkeypatch):
    # Past the shared-memory filesystem's end a write into a shared page is SIGBUS, not an
    # error: the weights must not move there, and the call must still return its results.
    monkeypatch.setattr(helper_processes, "shared_memory_free_bytes", lambda: 1024)
    model = _model(tokenizer)
    single, split = _engine(model, tokenizer), _engine(model, tokenizer, processes=2)
    requests = _requests(tokenizer)
    with pytest.warns(RuntimeWarning, match=r"MiB of shared memory .* has 0 MiB free"):
        expected, got = _generate_both(single, split, requests, entropy_seed=7)
    _assert_same(got, expected)
    assert split.helpers.num_running == 0
    assert not any(p.is_shared() for p in model.parameters())
    assert len(split.helpers.plan(requests)) == 1  # no more splitting


def test_ctrl_c_is_left_to_the_parent(tokenizer):
    # A terminal's Ctrl-C reaches the helpers too; they must not die (or print tracebacks)
    # of it: the parent decides, and a helper stops when its connection closes.
    single, split, requests, helper = _one_helper_running(tokenizer)
    helper.process.send_signal(signal.SIGINT)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a dropped helper would warn
        expected, got = _generate_both(single, split, requests, entropy_seed=9)
    _assert_same(got, expected)
    assert split.helpers.num_running == 1 and helper.process.poll() is None
    split.close()
    assert helper.process.poll() is not None


def test_small_calls_and_cuda_settings_do_not_split(pair, tokenizer):
    _, _, split = pair
    requests = _requests(tokenizer)
    assert len(split.helpers.plan(requests[:1])) == 1  # one request
    tiny = [SampleRequest(prompt=[1, 2], num_samples=2)] * 3  # 6 samples < 2 x min rows
    assert len(split.helpers.plan(tiny)) == 1
    assert type(_engine(split.model, tokenizer)) is SamplerEngine  # processes=1: no wrapper


def test_by_default_a_cpu_engine_splits_over_a_process_per_core(tokenizer, monkeypatch):
    model = _model(tokenizer)
    config = SamplerEngine.Config(max_batch=16, max_seq_len=48)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    sampler = config.build(model=model, tokenizer=tokenizer)
    assert isinstance(sampler, ProcessSplitSampler) and sampler.helpers.max_helpers == 1
    # A call under 2 x process_min_rows samples (one prompt, a small group) starts nothing.
    sampler.sample([1, 2, 3], SamplingParams(max_tokens=2, seed=0), num_samples=8)
    assert sampler.helpers.num_running == 0
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert type(config.build(model=model, tokenizer=tokenizer)) is SamplerEngine


def test_the_engines_part_of_a_split_call_runs_on_its_share_of_the_threads(tokenizer, monkeypatch):
    # With num_threads unset, 2 processes on 4 threads run 2 threads each: the engine's own
    # part must not keep all 4 while its helper computes beside it.
    previous = torch.get_num_threads()
    torch.set_num_threads(4)
    engine = _engine(_model(tokenizer), tokenizer, num_threads=None, processes=2)
    seen = []
    decode_step = engine.engine._decode_step
    monkeypatch.setattr(
        engine.engine,
        "_decode_step",
        lambda d: (seen.append(torch.get_num_threads()), decode_step(d)),
    )
    try:
        engine.generate(_requests(tokenizer))
        assert engine.helpers.num_running == 1 and engine.helpers.threads == 2
        assert set(seen) == {2}
        assert torch.get_num_threads() == 4  # restored after the call
        seen.clear()
        engine.generate(_requests(tokenizer)[:1])  # not split: all the threads
        assert set(seen) == {4}
    finally:
        engine.close()
        torch.set_num_threads(previous)


@pytest.mark.parametrize("value", [0, -1, True, 2.0, "many"])
def test_bad_cpu_processes_is_named(value):
    message = r"SamplerEngine\.Config\.cpu\.processes must be 'auto' or an int >= 1"
    with pytest.raises(ValueError, match=message):
        CpuDecoding.Config(processes=value)


def test_plan_respects_min_rows_and_max_helpers():
    helpers = HelperProcesses(
        max_helpers=3, min_rows=8, config=SamplerEngine.Config(), tokenizer=None, threads=1
    )
    requests = [SampleRequest(prompt=[1], num_samples=8)] * 16
    assert [len(part) for part in helpers.plan(requests)] == [4, 4, 4, 4]
    assert [len(part) for part in helpers.plan(requests[:3])] == [1, 1, 1]
    assert len(helpers.plan(requests[:1])) == 1


@given(
    rows=st.lists(st.integers(min_value=1, max_value=20), min_size=2, max_size=30),
    data=st.data(),
)
def test_balanced_ranges_cover_the_requests_in_order(rows, data):
    num_parts = data.draw(st.integers(min_value=2, max_value=len(rows)))
    parts = _balanced_ranges(rows, num_parts)
    assert len(parts) == num_parts and all(len(part) > 0 for part in parts)
    assert [index for part in parts for index in part] == list(range(len(rows)))
    if len(set(rows)) == 1 and len(rows) % num_parts == 0:  # equal requests: equal parts
        assert {len(part) for part in parts} == {len(rows) // num_parts}


def test_a_script_without_a_main_guard_runs_once(tmp_path):
    # Helpers import only the sampler, never the parent's __main__ (multiprocessing's spawn
    # would run this whole script again inside the helper).
    runs = tmp_path / "runs.txt"
    script = tmp_path / "script.py"
    script.write_text(
        f"""
from pathlib import Path
from temper.api import SamplingParams
from temper.models import materialize, qwen3_moe_size, qwen3_size
from temper.sampler.cpu.decoding import CpuDecoding
from temper.sampler.engine import SamplerEngine, SampleRequest

with Path({str(runs)!r}).open("a") as runs:
    runs.write("ran\\n")
model = materialize(qwen3_size("tiny", vocab_size=32), seed=0)
config = SamplerEngine.Config(max_batch=32, max_seq_len=16, cpu=CpuDecoding.Config(processes=2))
engine = config.build(model=model)
request = SampleRequest(prompt=[1, 2], params=SamplingParams(max_tokens=3, seed=0), num_samples=16)
responses = engine.generate([request, request])
assert engine.helpers.num_running == 1 and len(responses) == 2
print("ok")
"""
    )
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
    assert runs.read_text() == "ran\n"


def test_a_failing_local_part_leaves_no_reply_behind(pair, tokenizer, monkeypatch):
    _, single, split = pair
    requests = _requests(tokenizer)

    def interrupted(requests, **options):
        raise KeyboardInterrupt

    monkeypatch.setattr(split.engine, "generate", interrupted)
    with pytest.raises(KeyboardInterrupt):
        split.generate(requests)
    monkeypatch.undo()
    # The helpers' replies to the interrupted call were drained: this call gets its own.
    expected, got = _generate_both(single, split, requests[::-1], entropy_seed=7)
    _assert_same(got, expected)
