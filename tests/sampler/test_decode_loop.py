"""Calls join a running batch (sampler/decode_loop.py) and long prompts enter it in chunks
(sampler/chunked_prefill.py): a call submitted while another decodes shares its decode steps
(counted, never timed) and gets what it gets alone (seeded tokens equal, logprobs within
float rounding, as tests/sampler/test_engine.py holds batches to); a failing call fails
alone; a weight update waits for the calls before it."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from temper.api import SamplingParams
from temper.models import materialize, qwen3_size
from temper.models.qwen3_5 import qwen3_5_size
from temper.sampler.cpu.decoding import CpuDecoding
from temper.sampler.engine import SamplerEngine, SampleRequest
from temper.sampler.oracle import greedy_decode

VOCAB = 31
LONG = [(7 * i + 3) % VOCAB for i in range(40)]  # 40 tokens: chunks of 16, 16 and 8


def _model(size_fn):
    config = dataclasses.replace(size_fn("tiny", vocab_size=VOCAB), init_std=0.1)
    return materialize(config, seed=5, dtype="float32").eval()


@pytest.fixture(scope="module")
def model():
    return _model(qwen3_size)


def _engine(model, **config):
    defaults = {"max_batch": 8, "max_seq_len": 96, "cpu": CpuDecoding.Config(processes=1)}
    return SamplerEngine.Config(**{**defaults, "prefill_chunk_tokens": 16, **config}).build(
        model=model
    )


def _requests(seed, *, prompts=([3, 4, 5], [9, 9]), max_tokens=8):
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed)
    return [SampleRequest(prompt=p, params=params, num_samples=2) for p in prompts]


def _assert_same(ours, theirs):
    for a, b in zip(ours, theirs, strict=True):
        assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
        for x, y in zip(a.sequences, b.sequences, strict=True):
            torch.testing.assert_close(
                torch.tensor(x.logprobs), torch.tensor(y.logprobs), rtol=0, atol=1e-5
            )


class JoinAtStep:
    """Runs `first` on this thread; at its engine step `at`, starts `second` on another
    thread and holds the step until that call waits in the loop. Records the rows of every
    decode step."""

    def __init__(self, engine, *, at=3):
        self.engine, self.at = engine, at
        self.rows_per_step: list[int] = []
        self.results: dict[str, object] = {}

    def run(self, first, second):
        engine, step = self.engine, self.engine.step
        thread = threading.Thread(target=self._call, args=("second", second))

        def counted_step():
            if len(self.rows_per_step) == self.at:
                thread.start()
                while engine.loop.num_pending == 0:
                    threading.Event().wait(0.001)  # the second call is about to wait
            step()
            self.rows_per_step.append(engine.slots.num_active)

        engine.step = counted_step
        try:
            self._call("first", first)
            thread.join()
        finally:
            del engine.step
        return self.results["first"], self.results["second"]

    def _call(self, name, fn):
        try:
            self.results[name] = fn()
        except Exception as error:
            self.results[name] = error


def test_a_call_submitted_while_another_decodes_joins_its_batch_and_equals_alone(model):
    engine = _engine(model)
    first, second = _requests(1, max_tokens=20), _requests(2)
    joining = JoinAtStep(engine)
    ours_first, ours_second = joining.run(
        lambda: engine.generate(first), lambda: engine.generate(second)
    )
    assert engine.loop.num_batches == 1 and engine.loop.num_joined_running == 1
    assert max(joining.rows_per_step) == 8  # both calls' rows in one step
    _assert_same(ours_first, _engine(model).generate(first))
    _assert_same(ours_second, _engine(model).generate(second))


def test_a_long_prompt_joins_in_chunks_and_equals_alone(model):
    engine = _engine(model)
    long = [SampleRequest(prompt=LONG, params=SamplingParams(max_tokens=6, seed=4))]
    joining = JoinAtStep(engine)
    running, joined = joining.run(
        lambda: engine.generate(_requests(1, max_tokens=20)), lambda: engine.generate(long)
    )
    assert engine.chunks.chunk_sizes == [16, 16, 8]  # one chunk per step, the prompt's own
    alone = _engine(model)
    _assert_same(joined, alone.generate(long))
    assert alone.chunks.chunk_sizes == [16, 16, 8]
    _assert_same(running, _engine(model).generate(_requests(1, max_tokens=20)))


@pytest.mark.parametrize("size_fn", [qwen3_size, qwen3_5_size], ids=["dense", "hybrid"])
def test_chunked_prefill_decodes_the_prompt_as_a_full_forward(size_fn):
    """Greedy tokens after a prompt prefilled in chunks (a hybrid model's recurrent states
    carried from chunk to chunk) equal the full-forward reference; also after a cached
    prefix (a second turn)."""
    model = _model(size_fn)
    engine = _engine(model, prefill_chunk_tokens=8)
    expected = greedy_decode(model, [LONG], max_new_tokens=6)[0]
    params = SamplingParams(max_tokens=6, temperature=0)
    (sequence,) = engine.sample(LONG, params).sequences
    assert sequence.tokens == expected and engine.chunks.chunk_sizes == [8] * 5
    turn = [*LONG, *sequence.tokens[:-1], 5, 6, 7, 8, 9, 10, 11, 12, 13]
    (second,) = engine.sample(turn, params).sequences
    assert second.tokens == greedy_decode(model, [turn], max_new_tokens=6)[0]
    assert sum(engine.chunks.chunk_sizes[5:]) < len(turn)  # it started from the cached turn


def test_a_failing_call_fails_alone_and_the_running_one_finishes(model):
    engine = _engine(model)

    def refused(states):
        raise RuntimeError("no slot for you")

    joining = JoinAtStep(engine)
    ours, error = joining.run(
        lambda: engine.generate(_requests(1, max_tokens=12)),
        lambda: engine.generate(_requests(2), adapter_gate=refused),
    )
    assert isinstance(error, RuntimeError) and "no slot for you" in str(error)
    _assert_same(ours, _engine(model).generate(_requests(1, max_tokens=12)))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate([SampleRequest(prompt=[1, 99])])
    _assert_same(engine.generate(_requests(3)), _engine(model).generate(_requests(3)))


def test_a_weight_update_waits_for_the_calls_before_it():
    model = _model(qwen3_size)  # its own: the update writes its tensors in place
    engine = _engine(model)
    newer = _model(qwen3_size)
    with torch.no_grad():
        for parameter in newer.parameters():
            parameter.mul_(0.5)
    joining = JoinAtStep(engine)
    ours, _ = joining.run(
        lambda: engine.generate(_requests(1, max_tokens=20)),
        lambda: engine.update_weights(newer.state_dict(), version=7),
    )
    old = _engine(_model(qwen3_size)).generate(_requests(1, max_tokens=20))
    _assert_same(ours, old)  # the call before the update ran on the old weights
    assert engine.version == 7
    expected = _engine(_model(qwen3_size))
    expected.update_weights(newer.state_dict(), version=7)
    _assert_same(engine.generate(_requests(2)), expected.generate(_requests(2)))
