"""Decode steps split into row shards on worker threads: the same tokens and logprobs, bitwise,
as unsplit steps on one thread (greedy, seeded sampling with truncation, continuous batching,
stops, top-k logprobs, bf16 packed weights; a MoE model in bf16, and in fp32 to float
rounding), and how a step is split."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from temper.api import SamplingParams
from temper.models import materialize, qwen3_moe_size, qwen3_size
from temper.sampler.cpu.decode_shards import DecodeShards, even_ranges
from temper.sampler.cpu.decoding import CpuDecoding
from temper.sampler.engine import SamplerEngine, SampleRequest

VOCAB = 61


def _model(*, dtype="float32", size=qwen3_size):
    config = dataclasses.replace(size("tiny", vocab_size=VOCAB), init_std=0.1)
    return materialize(config, seed=3, dtype=dtype).eval()


@pytest.fixture(scope="module")
def model():
    return _model()


def _generate(model, requests, *, decode_shards, max_batch=12):
    """On one thread (prefill too; the shards' workers are single-threaded anyway), so
    decode_shards=1 is the reference: unsplit one-thread steps. (An unsplit step on several
    intra-op threads rounds differently: see decode_shards.py.)"""
    engine = SamplerEngine.Config(
        max_batch=max_batch,
        max_seq_len=64,
        cpu=CpuDecoding.Config(decode_shards=decode_shards, num_threads=1, processes=1),
    ).build(model=model)
    return engine, engine.generate(requests)


def _mixed_requests() -> list[SampleRequest]:
    """Different prompt lengths, lengths to generate, parameters and sample counts: more
    samples than slots, so sequences finish and new ones start mid-run."""
    generator = torch.Generator().manual_seed(0)
    params = [
        SamplingParams(max_tokens=9, temperature=0),
        SamplingParams(max_tokens=14, temperature=1.0, seed=7),
        SamplingParams(max_tokens=5, temperature=0.7, top_k=5, seed=8),
        SamplingParams(max_tokens=12, temperature=1.2, top_p=0.8, seed=9),
        SamplingParams(max_tokens=11, temperature=0.9, top_k=20, top_p=0.9, seed=10),
    ]
    requests = []
    for index in range(10):
        length = 1 + (5 * index) % 13
        prompt = torch.randint(0, VOCAB, (length,), generator=generator).tolist()
        requests.append(
            SampleRequest(
                prompt=prompt, params=params[index % len(params)], num_samples=1 + index % 3
            )
        )
    return requests


def _assert_bitwise_equal(expected, actual):
    for response_a, response_b in zip(expected, actual, strict=True):
        for a, b in zip(response_a.sequences, response_b.sequences, strict=True):
            assert a.tokens == b.tokens
            assert a.logprobs == b.logprobs  # Python floats: bitwise
            assert a.stop_reason == b.stop_reason
            assert a.topk_logprobs == b.topk_logprobs


@pytest.mark.parametrize("num_shards", [2, 3, 5])
def test_sharded_decode_is_bitwise_the_unsharded_decode(model, num_shards):
    requests = _mixed_requests()
    _, unsharded = _generate(model, requests, decode_shards=1)
    engine, sharded = _generate(model, requests, decode_shards=num_shards)
    _assert_bitwise_equal(unsharded, sharded)
    assert engine.decoding.shards._workers is not None  # the split path really ran
    sampled = [seq.tokens for r in sharded[1:] for seq in r.sequences]
    assert len(set(map(tuple, sampled))) > 3  # rows really differ


def test_greedy_sharded_batch_matches_each_prompt_alone(model):
    prompts = [[(7 * row + step) % VOCAB for step in range(1 + row % 6)] for row in range(12)]
    params = SamplingParams(max_tokens=8, temperature=0)
    requests = [SampleRequest(prompt=prompt, params=params) for prompt in prompts]
    _, sharded = _generate(model, requests, decode_shards=4)
    for prompt, response in zip(prompts, sharded, strict=True):
        _, (alone,) = _generate(
            model, [SampleRequest(prompt=prompt, params=params)], decode_shards=1
        )
        assert response.sequences[0].tokens == alone.sequences[0].tokens


def test_stop_tokens_and_topk_logprobs_with_shards(model):
    _, free = _generate(
        model,
        [SampleRequest(prompt=[1, 2, 3], params=SamplingParams(max_tokens=12, temperature=0))],
        decode_shards=1,
    )
    stop_token = free[0].sequences[0].tokens[3]
    requests = [
        SampleRequest(
            prompt=[1, 2, 3],
            params=SamplingParams(max_tokens=12, temperature=0.8, seed=1, stop=[stop_token]),
            num_samples=6,
            topk_sample_logprobs=3,
        ),
        SampleRequest(
            prompt=[4, 5], params=SamplingParams(max_tokens=12, temperature=0), num_samples=4
        ),
    ]
    _, unsharded = _generate(model, requests, decode_shards=1)
    _, sharded = _generate(model, requests, decode_shards=3)
    _assert_bitwise_equal(unsharded, sharded)
    assert all(len(s.topk_logprobs) == len(s.tokens) for s in sharded[0].sequences)


def test_bf16_packed_decode_with_shards():
    model = _model(dtype="bfloat16")
    requests = _mixed_requests()
    _, unsharded = _generate(model, requests, decode_shards=1)
    _, sharded = _generate(model, requests, decode_shards=2)
    _assert_bitwise_equal(unsharded, sharded)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_moe_decode_with_shards(dtype):
    """A MoE layer multiplies each expert's rows of the step (or shard) at once. In fp32 an
    expert given 1-3 rows in one split and more in another rounds apart (the GEMM kernel
    changes, see decode_shards.py), so logprobs agree to float rounding; in bf16 (packed, as
    on any oneDNN kernel) a row's bits do not depend on the rows beside it."""
    model = _model(dtype=dtype, size=qwen3_moe_size)
    requests = _mixed_requests()
    _, unsharded = _generate(model, requests, decode_shards=1)
    _, sharded = _generate(model, requests, decode_shards=3)
    if dtype == "bfloat16":
        _assert_bitwise_equal(unsharded, sharded)
        return
    for response_a, response_b in zip(unsharded, sharded, strict=True):
        for a, b in zip(response_a.sequences, response_b.sequences, strict=True):
            assert a.tokens == b.tokens
            torch.testing.assert_close(
                torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-5
            )


def test_shards_run_on_worker_threads_under_inference_mode(model):
    engine = SamplerEngine.Config(
        max_batch=8, max_seq_len=32, cpu=CpuDecoding.Config(decode_shards=2, processes=1)
    ).build(model=model)
    seen = []
    original = engine._decode_rows

    def spy(rows, **kwargs):
        seen.append((threading.current_thread().name, torch.is_inference_mode_enabled()))
        return original(rows, **kwargs)

    engine._decode_rows = spy
    engine.sample([1, 2], SamplingParams(max_tokens=3, temperature=0), num_samples=8)
    assert seen and all(name.startswith("temper-shard") and mode for name, mode in seen)


def test_auto_splits_by_threads_and_rows_per_shard():
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        shards = DecodeShards(setting="auto", min_rows=16)
        assert shards.plan(31) == [range(0, 31)]
        assert shards.plan(32) == [range(0, 16), range(16, 32)]
        assert shards.plan(128) == [range(0, 64), range(64, 128)]
        torch.set_num_threads(1)
        assert shards.plan(128) == [range(0, 128)]
    finally:
        torch.set_num_threads(threads)
    # Never fewer than 4 rows a shard (fp32 matmuls of 1-3 rows round differently).
    assert DecodeShards(setting=3, min_rows=16).plan(3) == [range(0, 3)]
    assert DecodeShards(setting=3, min_rows=16).plan(9) == [range(0, 5), range(5, 9)]
    assert DecodeShards(setting=3, min_rows=16).plan(12) == [range(0, 4), range(4, 8), range(8, 12)]
    assert DecodeShards(setting="auto", min_rows=2).plan(7) == [range(0, 7)]
    assert DecodeShards(setting=1, min_rows=16).plan(64) == [range(0, 64)]


def test_auto_follows_the_engine_thread_setting(model):
    def engine(num_threads):
        cpu = CpuDecoding.Config(
            decode_shards="auto", decode_shard_min_rows=4, num_threads=num_threads, processes=1
        )
        return SamplerEngine.Config(max_batch=8, max_seq_len=32, cpu=cpu).build(model=model)

    two = engine(2)
    two.sample([1, 2], SamplingParams(max_tokens=3, temperature=0), num_samples=8)
    assert two.decoding.shards._workers is not None
    one = engine(1)
    one.sample([1, 2], SamplingParams(max_tokens=3, temperature=0), num_samples=8)
    assert one.decoding.shards._workers is None


@pytest.mark.parametrize("rows,shards", [(10, 3), (7, 7), (128, 2), (5, 1)])
def test_even_ranges_cover_rows_in_order(rows, shards):
    ranges = even_ranges(rows, shards)
    assert len(ranges) == shards
    assert [row for r in ranges for row in r] == list(range(rows))
    assert max(map(len, ranges)) - min(map(len, ranges)) <= 1


@pytest.mark.parametrize(
    "config,message",
    [
        ({"decode_shards": 0}, r"cpu\.decode_shards must be 'auto' or an int >= 1, got 0"),
        ({"decode_shards": "two"}, r"cpu\.decode_shards must be 'auto' or an int >= 1"),
        ({"decode_shard_min_rows": 0}, r"cpu\.decode_shard_min_rows must be an int >= 1, got 0"),
    ],
)
def test_bad_shard_settings_are_named(config, message):
    with pytest.raises(ValueError, match=message):
        CpuDecoding.Config(**config)
