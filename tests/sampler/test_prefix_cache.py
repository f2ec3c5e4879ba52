"""The prefix cache: a prompt that extends a finished sequence prefills only its new tokens,
and samples what a cold engine samples (tokens equal, logprobs to float rounding)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from temper.api import SamplingParams
from temper.models import materialize, qwen3_size
from temper.sampler.admission import Admission
from temper.sampler.cpu.decoding import CpuDecoding
from temper.sampler.engine import SamplerEngine, SampleRequest
from temper.sampler.prefix_cache import BLOCK, PrefixCache

VOCAB = 31


@pytest.fixture(scope="module")
def model():
    config = dataclasses.replace(qwen3_size("tiny", vocab_size=VOCAB), init_std=0.1)
    return materialize(config, seed=5, dtype="float32").eval()


def _engine(model, **config):
    fields = {"max_batch": 8, "max_seq_len": 64, "cpu": CpuDecoding.Config(processes=1)}
    return SamplerEngine.Config(**{**fields, **config}).build(model=model)


def _conversations(engine, *, turns, seed=0):
    """Three multi-turn conversations decoded turn by turn, in one batch per turn: each
    turn's prompt is the last prompt, its completion and an 'observation' of two tokens."""
    prompts = [[3, 4, 5], [7, 1], [2, 2, 2, 9]]
    transcript = []
    for turn in range(turns):
        requests = [
            SampleRequest(
                prompt=prompt,
                params=SamplingParams(max_tokens=3 + i, seed=seed + 10 * turn + i),
            )
            for i, prompt in enumerate(prompts)
        ]
        sequences = [response.sequences[0] for response in engine.generate(requests)]
        transcript.append(sequences)
        observation = [turn + 1, 30 - turn]
        prompts = [p + s.tokens + observation for p, s in zip(prompts, sequences, strict=True)]
    return transcript


def test_later_turns_prefill_only_their_new_tokens_and_sample_what_a_cold_engine_does(
    model, monkeypatch
):
    prefilled = []
    prefill = Admission._prefill

    def counting(self, rows):
        prefilled.append(sum(len(state.prompt) - (c.length if c else 0) for state, _, c in rows))
        return prefill(self, rows)

    monkeypatch.setattr(Admission, "_prefill", counting)
    warm = _engine(model)
    cached = _conversations(warm, turns=4)
    # Turn 1 prefills the three prompts (9 tokens); every later turn only each
    # conversation's last sampled token and its two observation tokens.
    assert prefilled == [9, 9, 9, 9]
    assert warm.prefix_cache.num_hits == 9
    prefilled.clear()
    cold = _conversations(_engine(model, prefix_cache_mib=0), turns=4)
    assert prefilled[0] == 9 and all(count > 9 + 9 for count in prefilled[1:])  # all again
    for warm_turn, cold_turn in zip(cached, cold, strict=True):
        for a, b in zip(warm_turn, cold_turn, strict=True):
            _assert_same_sample(a, b)


def _assert_same_sample(a, b):
    """The same tokens; logprobs equal to float rounding (a cached prefix was computed in
    other batches, partly by the decode path)."""
    assert a.tokens == b.tokens
    torch.testing.assert_close(
        torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-5
    )


def test_requests_with_the_same_prompt_share_one_prefill(model, monkeypatch):
    rows = []
    prefill = Admission._prefill
    monkeypatch.setattr(
        Admission, "_prefill", lambda self, r: (rows.append(len(r)), prefill(self, r))
    )
    requests = [
        SampleRequest(prompt=prompt, params=SamplingParams(max_tokens=5, seed=seed))
        for seed, prompt in enumerate([[3, 4, 5], [3, 4, 5], [7, 1], [3, 4, 5]])
    ]
    shared = _engine(model).generate(requests)
    assert rows == [2]  # two distinct prompts
    for request, response in zip(requests, shared, strict=True):
        (alone,) = _engine(model).generate([request])
        _assert_same_sample(response.sequences[0], alone.sequences[0])


def test_a_cached_row_and_a_longer_cold_prompt_prefill_together(model):
    # The cached row's padding would run past the end of its slot (starts at 53, 25 padded
    # tokens > 64 positions): only real tokens are written.
    engine = _engine(model, max_seq_len=64)
    long_prompt = [(7 * i) % VOCAB for i in range(50)]
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=1)
    (first,) = engine.generate([SampleRequest(prompt=long_prompt, params=params)])
    extended = long_prompt + first.sequences[0].tokens + [2]
    cold_prompt = [(3 * i + 1) % VOCAB for i in range(25)]
    requests = [SampleRequest(prompt=p, params=params) for p in (extended, cold_prompt)]
    warm = engine.generate(requests)
    assert engine.prefix_cache.num_hits == 1 and engine.prefix_cache.num_hit_tokens == 53
    cold = _engine(model, max_seq_len=64, prefix_cache_mib=0).generate(requests)
    for a, b in zip(warm, cold, strict=True):
        _assert_same_sample(a.sequences[0], b.sequences[0])


def test_new_weights_empty_the_cache(model):
    engine = _engine(model)
    _conversations(engine, turns=1)
    assert len(engine.prefix_cache) == 3
    other = _model_copy(model, seed=9)
    engine.update_weights(other, version=1)
    turns = _conversations(engine, turns=2)
    assert engine.prefix_cache.num_hits == 3  # turn 2 only: nothing from the old weights
    fresh = _conversations(_engine(other, prefix_cache_mib=0), turns=2)
    assert [[s.tokens for s in t] for t in turns] == [[s.tokens for s in t] for t in fresh]


def _model_copy(model, *, seed):
    config = dataclasses.replace(model.config)
    return materialize(config, seed=seed, dtype="float32").eval()


def test_prompt_logprob_requests_compute_every_position(model):
    engine = _engine(model)
    (turn,) = _conversations(engine, turns=1)
    prompt = [3, 4, 5, *turn[0].tokens, 1]
    response = engine.sample(prompt, SamplingParams(max_tokens=2, seed=0), prompt_logprobs=True)
    assert engine.prefix_cache.num_hits == 0
    expected = engine.score([prompt])[0]
    torch.testing.assert_close(torch.tensor(response.prompt_logprobs[1:]), expected)


def test_the_least_recently_used_entries_go_first():
    def store(cache, tokens):
        k_LFKCH = torch.zeros(1, 1, 1, len(tokens), 4)  # 16 bytes a position
        cache.store([tokens], adapters=[0], k_LFKCH=k_LFKCH, v_LFKCH=k_LFKCH.clone())

    cache = PrefixCache(max_bytes=2 * 4 * 4 * 10)  # room for 10 positions
    for tokens in ([1, 2, 3], [4, 5, 6, 7], [8, 9]):
        store(cache, tokens)
    assert cache.longest([1, 2, 3, 0], adapter=0).length == 3  # used: now the newest
    assert cache.longest([1, 2, 3, 0], adapter=1) is None  # another adapter's slot
    store(cache, [5, 5, 5])  # 12 positions: one must go
    assert cache.longest([4, 5, 6, 7, 0], adapter=0) is None
    assert cache.longest([1, 2, 3, 0], adapter=0) is not None
    assert cache.longest([1, 2, 3], adapter=0) is None  # a whole match leaves nothing to compute
    assert cache.nbytes == 2 * 4 * 4 * 8
    cache.drop_adapter(0)
    assert len(cache) == 0 and cache.nbytes == 0


def test_a_prompt_sharing_whole_blocks_with_an_entry_copies_those_blocks():
    cache = PrefixCache(max_bytes=2**20)
    stored = list(range(1, 41))  # 40 tokens: blocks end at 16 and 32
    k_LFKCH = torch.arange(40.0).reshape(1, 1, 1, 40, 1)
    cache.store([stored], adapters=[0], k_LFKCH=k_LFKCH, v_LFKCH=-k_LFKCH)
    shares_35 = [*stored[:35], 0, 0]
    hit = cache.longest(shares_35, adapter=0)
    assert hit.length == 2 * BLOCK and hit.tokens == tuple(stored[: 2 * BLOCK])
    keys, values = hit.keys_values()
    assert keys.flatten().tolist() == list(range(2 * BLOCK)) and torch.equal(values, -keys)
    assert cache.longest([*stored[:20], 0], adapter=0).length == BLOCK
    assert cache.longest([*stored[:15], 0, 0], adapter=0) is None  # no whole block in common
    assert cache.longest([*stored[:35], 0], adapter=1) is None  # another adapter's slot
    assert cache.longest([*stored, 7], adapter=0).length == 40  # the whole entry wins
    cache.clear()
    assert cache.longest(shares_35, adapter=0) is None
    cache.store([stored], adapters=[0], k_LFKCH=k_LFKCH, v_LFKCH=-k_LFKCH)
    cache.drop_adapter(0)  # an entry that goes takes its block keys with it
    assert cache.longest(shares_35, adapter=0) is None and not cache._blocks


def test_two_conversations_with_one_system_prompt_share_its_blocks(model, monkeypatch):
    prefilled = []
    prefill = Admission._prefill
    monkeypatch.setattr(
        Admission,
        "_prefill",
        lambda self, rows: (
            prefilled.append([len(s.prompt) - (c.length if c else 0) for s, _, c in rows]),
            prefill(self, rows),
        )[1],
    )
    system = [(5 * i + 2) % VOCAB for i in range(37)]  # 37 tokens: two whole blocks
    params = SamplingParams(max_tokens=4, seed=3)
    engine = _engine(model)
    first = SampleRequest(prompt=[*system, 1, 2, 3], params=params)
    second = SampleRequest(prompt=[*system, 9, 8], params=params)
    engine.generate([first])
    (warm,) = engine.generate([second])
    assert prefilled == [[40], [39 - 2 * BLOCK]]
    (cold,) = _engine(model, prefix_cache_mib=0).generate([second])
    _assert_same_sample(warm.sequences[0], cold.sequences[0])


def test_prefix_cache_mib_is_checked():
    with pytest.raises(ValueError, match="prefix_cache_mib must be >= 0"):
        SamplerEngine.Config(prefix_cache_mib=-1)
