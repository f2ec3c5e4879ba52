"""The KV-cache engine on a hybrid model (tiny Qwen3.5: 3 Gated DeltaNet layers, 1 full
attention): its recurrent-state pool against full forwards (the chunked form) through
admission, group prefill, waiting samples, slot reuse, compaction, sleep/wake, the prefix
cache, decode shards and the static (CUDA-graph) step."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from temper.api import SamplingParams
from temper.models import materialize
from temper.models.qwen3_5 import qwen3_5_size
from temper.sampler.cpu.decoding import CpuDecoding
from temper.sampler.engine import SamplerEngine, SampleRequest
from temper.sampler.oracle import greedy_decode

ONE_PROCESS = CpuDecoding.Config(processes=1)
VOCAB = 31
PROMPTS = [[3, 4, 5], [7], [1, 2, 3, 4, 5, 6, 7, 8], [9, 9], [2, 2, 2, 2, 2], [5, 6], [30, 0, 1]]


@pytest.fixture(scope="module")
def model():
    # A larger init than training uses, so greedy outputs vary (as tests/sampler/test_engine.py).
    config = dataclasses.replace(qwen3_5_size("tiny", vocab_size=VOCAB), init_std=0.1)
    return materialize(config, seed=5, dtype="float32").eval()


def _engine(model, **config):
    return SamplerEngine.Config(
        **{"max_batch": 8, "max_seq_len": 96, "cpu": ONE_PROCESS, **config}
    ).build(model=model)


def _greedy(max_tokens):
    return SamplingParams(max_tokens=max_tokens, temperature=0)


def _assert_same(a, b, *, atol=0.0):
    """Two responses' sequences: equal tokens, logprobs within `atol` (0: bitwise)."""
    assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
    for x, y in zip(a.sequences, b.sequences, strict=True):
        torch.testing.assert_close(
            torch.tensor(x.logprobs), torch.tensor(y.logprobs), rtol=0, atol=atol
        )


def test_greedy_decode_equals_full_forward_argmax_with_slots_reused(model):
    """Recurrent decode vs the chunked full forward: 7 requests through 3 slots (waiting,
    slot reuse, sequences finishing below running ones), and each sampled token's logprob
    against a teacher-forced full forward of the whole sample."""
    engine = _engine(model, max_batch=3)
    requests = [SampleRequest(prompt=p, params=_greedy(4 + 3 * i)) for i, p in enumerate(PROMPTS)]
    for prompt, request, response in zip(PROMPTS, requests, engine.generate(requests), strict=True):
        (sequence,) = response.sequences
        expected = greedy_decode(model, [prompt], max_new_tokens=request.params.max_tokens)[0]
        assert sequence.tokens == expected
        scored = engine.score([prompt + sequence.tokens])[0][len(prompt) - 1 :]
        torch.testing.assert_close(torch.tensor(sequence.logprobs), scored, rtol=0, atol=5e-5)
    assert len({tuple(r.sequences[0].tokens) for r in engine.generate(requests)}) > 1


def test_a_sequence_finishing_below_others_moves_their_states_down(model):
    engine = _engine(model, max_batch=4)
    lengths = [2, 12, 3, 12]  # slots 0 and 2 finish first; 1 and 3 keep decoding after a move
    requests = [SampleRequest(prompt=PROMPTS[i], params=_greedy(n)) for i, n in enumerate(lengths)]
    moves = []
    copy_slots = engine.cache.states.copy_slots
    engine.cache.states.copy_slots = lambda **kw: (moves.append(kw), copy_slots(**kw))[1]
    for request, response in zip(requests, engine.generate(requests), strict=True):
        expected = greedy_decode(model, [request.prompt], max_new_tokens=request.params.max_tokens)
        assert response.sequences[0].tokens == expected[0]
    assert {"sources": [3], "targets": [0]} in moves


def test_seeded_samples_are_reproducible_and_do_not_depend_on_the_batch(model):
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=1234)
    alone = _engine(model, max_batch=3).sample(PROMPTS[3], params, num_samples=3)
    crowd = [
        SampleRequest(prompt=PROMPTS[0], params=SamplingParams(max_tokens=7, temperature=0.5)),
        SampleRequest(prompt=PROMPTS[3], params=params, num_samples=3),
        SampleRequest(prompt=PROMPTS[2], params=SamplingParams(max_tokens=3, top_k=4, seed=9)),
    ]
    engine = _engine(model)
    in_crowd = engine.generate(crowd)[1]
    _assert_same(alone, in_crowd, atol=1e-5)
    _assert_same(in_crowd, engine.generate(crowd)[1])  # the same call again: bitwise
    assert len({tuple(s.tokens) for s in alone.sequences}) == 3


def test_samples_of_one_prompt_prefill_once_and_equal_separate_prefills(model, monkeypatch):
    """Group prefill: the first sample's slot is prefilled and its states copied to the
    others (enough slots) or saved for samples that wait (one slot); both equal the prompt
    sent as separate requests, each with its own prefill."""
    params = SamplingParams(max_tokens=8, temperature=0.9, seed=77)
    by_slots = {}
    for max_batch in (5, 1):
        engine = _engine(model, max_batch=max_batch)
        prefills = []
        original = engine.admission._prefill
        monkeypatch.setattr(
            engine.admission,
            "_prefill",
            lambda rows, o=original, seen=prefills: (seen.append(rows), o(rows)),
        )
        by_slots[max_batch] = engine.sample(PROMPTS[2], params, num_samples=4)
        assert len(prefills) == 1 and len(prefills[0]) == 1
    # Four rows decoding together against one at a time: the projections' matmuls round
    # differently by batch size, and a sampled token of low probability (logprob ~ -5) carries
    # that through four mixers; the same bound as decode against a full forward above.
    _assert_same(by_slots[5], by_slots[1], atol=5e-5)
    greedy = _engine(model, max_batch=5).sample(PROMPTS[4], _greedy(9), num_samples=4)
    expected = greedy_decode(model, [PROMPTS[4]], max_new_tokens=9)[0]
    assert [s.tokens for s in greedy.sequences] == [expected] * 4
    # The same prompts as separate requests admitted together share one prefill too; with
    # prompt logprobs asked (no sharing) each prefills on its own: the same samples.
    separate = [SampleRequest(prompt=PROMPTS[2], params=params, num_samples=4)]
    unshared = [dataclasses.replace(separate[0], prompt_logprobs=True)]
    _assert_same(
        _engine(model).generate(separate)[0], _engine(model).generate(unshared)[0], atol=1e-5
    )


def test_a_reused_slot_does_not_see_its_previous_occupants_state(model):
    request = SampleRequest(prompt=PROMPTS[0], params=SamplingParams(max_tokens=9, seed=3))
    fresh = _engine(model, max_batch=2).generate([request])[0]
    engine = _engine(model, max_batch=2, prefix_cache_mib=0)
    engine.generate([SampleRequest(prompt=p, params=_greedy(20)) for p in (PROMPTS[2], PROMPTS[6])])
    assert engine.cache.states.state_LSNKV[:, :2].abs().sum() > 0  # they left states behind
    _assert_same(fresh, engine.generate([request])[0])


def test_sleep_releases_the_state_pool_and_wake_up_keeps_results(model):
    engine = _engine(model)
    request = SampleRequest(prompt=PROMPTS[2], params=SamplingParams(max_tokens=9, seed=1))
    before = engine.generate([request])[0]
    pool_bytes = engine.cache.states.nbytes
    engine.sleep()
    assert engine.cache.nbytes == 0 and engine.cache.states.nbytes == 0
    with pytest.raises(ValueError, match="sleeps"):
        engine.generate([request])
    engine.wake_up()
    assert engine.cache.states.nbytes == pool_bytes
    _assert_same(before, engine.generate([request])[0])


def test_memory_is_known_up_front_and_the_pool_does_not_grow_with_length(model):
    config = model.config
    short = SamplerEngine.Config(max_batch=4, max_seq_len=128, cpu=ONE_PROCESS)
    long = dataclasses.replace(short, max_seq_len=2048)
    # Keys/values of the one full-attention layer only: 2 x 1 layer x 4 slots x 2 kv heads
    # x positions x 32 dims x 4 bytes.
    assert short.kv_cache_bytes(config, dtype=torch.float32) == 2 * 4 * 2 * 128 * 32 * 4
    assert long.kv_cache_bytes(config, dtype=torch.float32) == 2 * 4 * 2 * 2048 * 32 * 4
    # Per slot and linear layer: conv (2 x 64 + 128 channels x 3) + state (4 x 32 x 32), fp32.
    per_slot = 3 * (256 * 3 + 4 * 32 * 32) * 4
    for engine_config in (short, long):
        assert engine_config.recurrent_state_bytes(config, dtype=torch.float32) == 4 * per_slot
    engine = short.build(model=model)
    assert engine.cache.nbytes == short.kv_cache_bytes(config, dtype=torch.float32)
    assert engine.cache.states.nbytes == 4 * per_slot
    assert "recurrent states" in engine.describe()
    dense = dataclasses.replace(qwen3_5_size("tiny"), layer_types=("full_attention",) * 4)
    assert short.recurrent_state_bytes(dense, dtype=torch.float32) == 0


def test_a_next_turn_extends_the_whole_finished_sequence_with_its_states(model):
    """Multi-turn: turn 2's prompt is turn 1's prompt and completion plus an observation. It
    starts from turn 1's cached keys/values and final states and prefills only the rest,
    with the results of a full prefill; a prompt sharing only the start of a cached sequence
    cannot rewind its states and prefills from the start."""
    cached, uncached = _engine(model), _engine(model, prefix_cache_mib=0)
    params = SamplingParams(max_tokens=7, temperature=0.8, seed=21)
    first = PROMPTS[2] * 3
    turn_1 = cached.sample(first, params).sequences[0].tokens
    assert turn_1 == uncached.sample(first, params).sequences[0].tokens
    second = first + turn_1 + [11, 12, 13]
    hits = cached.prefix_cache.num_hit_tokens
    _assert_same(cached.sample(second, params), uncached.sample(second, params), atol=1e-5)
    assert cached.prefix_cache.num_hit_tokens - hits == len(first) + len(turn_1) - 1
    hits = cached.prefix_cache.num_hit_tokens
    branch = [*first[:20], 1, 2]  # shares 16+ tokens (a whole block) but not the whole entry
    _assert_same(cached.sample(branch, params), uncached.sample(branch, params), atol=1e-5)
    assert cached.prefix_cache.num_hit_tokens == hits


def test_prompt_logprobs_of_a_hybrid_prefill_equal_scoring(model):
    engine = _engine(model)
    requests = [  # right-padded together: the shorter row's states stop at its own end
        SampleRequest(prompt=p, params=_greedy(5), prompt_logprobs=True)
        for p in (PROMPTS[2], PROMPTS[0])
    ]
    for request, response in zip(requests, engine.generate(requests), strict=True):
        expected = engine.score([request.prompt])[0].tolist()
        assert response.prompt_logprobs[1:] == pytest.approx(expected, abs=1e-5)
        expected = greedy_decode(model, [request.prompt], max_new_tokens=5)[0]
        assert response.sequences[0].tokens == expected


def test_decode_shards_read_and_write_only_their_own_rows(model):
    requests = [
        SampleRequest(prompt=p, params=SamplingParams(max_tokens=8, seed=i))
        for i, p in enumerate([*PROMPTS, [4, 4]])
    ]
    # On one thread (prefill too), so the unsplit reference rounds as the shards' workers do.
    whole = _engine(model).generate(requests, num_threads=1)
    sharded = _engine(model, cpu=CpuDecoding.Config(processes=1, decode_shards=2, num_threads=1))
    assert sharded.decoding.shards.plan(8) == [range(4), range(4, 8)]
    # Tokens equal, logprobs to float rounding: the tiny model's gates (4 value heads per
    # row) are too few to fill a SIMD vector, so softplus/sigmoid over a step's 4 * B values
    # take the vectorized or the scalar tail path by the batch's size (a shape whose heads
    # fill whole vectors, as the published ones do, keeps rows bitwise).
    for a, b in zip(whole, sharded.generate(requests), strict=True):
        _assert_same(a, b, atol=1e-5)


def test_static_decode_step_matches_the_eager_step(model):
    """The CUDA-graph step (rows padded to a bucket, the pool's rows in place) run eagerly
    on CPU: padding rows decode in unoccupied slots, whose states are rewritten on admission."""
    from temper.sampler.cuda_graphs import CudaGraphDecoding

    engine = _engine(model, max_batch=8)
    requests = [SampleRequest(prompt=p, params=_greedy(9)) for p in PROMPTS[:3]]
    eager = engine.generate(requests)
    engine.decoding = CudaGraphDecoding(
        engine.weights, cache=engine.cache, buckets=[1, 4, 8], capture=False
    )
    for a, b in zip(eager, engine.generate(requests), strict=True):
        _assert_same(a, b, atol=1e-5)


def test_bf16_packed_decode_is_the_models_own_and_tracks_scoring():
    from temper.sampler.cpu.packed_linear import packing_available

    if not packing_available(torch.bfloat16):
        pytest.skip("oneDNN cannot pack bf16 weights on this CPU")
    config = dataclasses.replace(qwen3_5_size("tiny", vocab_size=VOCAB), init_std=0.1)
    model = materialize(config, seed=5, dtype="bfloat16").eval()
    request = SampleRequest(prompt=PROMPTS[2], params=SamplingParams(max_tokens=8, seed=4))
    responses = {}
    for packed in ("auto", "off"):
        engine = _engine(model, cpu=CpuDecoding.Config(processes=1, packed_linear=packed))
        assert engine.decoding.twin == ("packed" if packed == "auto" else "none")
        assert engine.cache.states.conv_LSCW.dtype == torch.bfloat16
        assert engine.cache.states.state_LSNKV.dtype == torch.float32
        responses[packed] = engine.generate([request])[0]
    _assert_same(responses["auto"], responses["off"])
    (sequence,) = responses["auto"].sequences
    expected = engine.score([PROMPTS[2] + sequence.tokens])[0][len(PROMPTS[2]) - 1 :]
    torch.testing.assert_close(torch.tensor(sequence.logprobs), expected, rtol=0, atol=0.15)
