"""The KV-cache engine against full-forward references: greedy tokens, logprobs, seeds, stops,
continuous batching, prefix sharing, weight updates and bad input."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from temper.api import SamplingParams
from temper.models import materialize, qwen3_size
from temper.models.common.logprobs import forward_logprobs
from temper.sampler.cpu.decoding import CpuDecoding
from temper.sampler.engine import SamplerEngine, SampleRequest
from temper.sampler.oracle import greedy_decode
from temper.tokenizer import build_builtin_tokenizer

ONE_PROCESS = CpuDecoding.Config(processes=1)
"""The engine alone: these tests read its own state (cache, slots, decode path)."""

VOCAB = 31


def _model(*, seed=5, vocab_size=VOCAB, dtype="float32"):
    # A larger init than training uses (logits of order 2 instead of 0.5), so distributions
    # are far from uniform and greedy outputs vary. KV-cache decode and a full forward differ
    # by float rounding (kernel shapes differ) that grows with logit size: ~2e-6 relative.
    config = dataclasses.replace(qwen3_size("tiny", vocab_size=vocab_size), init_std=0.1)
    return materialize(config, seed=seed, dtype=dtype).eval()


@pytest.fixture(scope="module")
def model():
    return _model()


def _engine(model, **config):
    return SamplerEngine.Config(
        **{"max_batch": 8, "max_seq_len": 96, "cpu": ONE_PROCESS, **config}
    ).build(model=model)


PROMPTS = [[3, 4, 5], [7], [1, 2, 3, 4, 5, 6, 7, 8], [9, 9], [2, 2, 2, 2, 2], [5, 6], [30, 0, 1]]


def test_greedy_equals_full_forward_argmax_with_continuous_batching(model):
    engine = _engine(model, max_batch=3)  # fewer slots than requests: slots get reused
    requests = [
        SampleRequest(prompt=p, params=SamplingParams(max_tokens=4 + 3 * i, temperature=0))
        for i, p in enumerate(PROMPTS)
    ]
    for prompt, request, response in zip(PROMPTS, requests, engine.generate(requests), strict=True):
        (sequence,) = response.sequences
        expected = greedy_decode(model, [prompt], max_new_tokens=request.params.max_tokens)[0]
        assert sequence.tokens == expected
        assert sequence.stop_reason == "length"
    assert len({tuple(r.sequences[0].tokens) for r in engine.generate(requests)}) > 1


def test_many_samples_start_and_finish_together_with_slots_moving_down(model):
    # Samples of prompts of different lengths start in one admission (one cache gather) and
    # several finish in the same step below running ones, which then move down together.
    engine = _engine(model, max_batch=9)
    lengths = [3, 7, 2, 9, 5]
    requests = [
        SampleRequest(
            prompt=PROMPTS[i], params=SamplingParams(max_tokens=n, temperature=0), num_samples=2
        )
        for i, n in zip(range(5), lengths, strict=True)
    ]
    seeded = [
        SampleRequest(prompt=r.prompt, params=SamplingParams(max_tokens=n, seed=i), num_samples=2)
        for i, (r, n) in enumerate(zip(requests, lengths, strict=True))
    ]
    responses = engine.generate(requests + seeded)
    for request, response in zip(requests, responses[:5], strict=True):
        expected = greedy_decode(model, [request.prompt], max_new_tokens=request.params.max_tokens)
        assert [s.tokens for s in response.sequences] == [expected[0]] * 2
    for request, response in zip(seeded, responses[5:], strict=True):
        alone = _engine(model, max_batch=2).generate([request])[0]
        assert [s.tokens for s in response.sequences] == [s.tokens for s in alone.sequences]
        for a, b in zip(alone.sequences, response.sequences, strict=True):
            torch.testing.assert_close(
                torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0
            )


def test_sampled_logprobs_equal_full_forward_logprobs(model):
    engine = _engine(model)
    params = SamplingParams(max_tokens=12, temperature=0.7, seed=11)
    response = engine.sample(PROMPTS[2], params, num_samples=5)
    for sequence in response.sequences:
        full = PROMPTS[2] + sequence.tokens
        expected = engine.score([full], temperature=0.7)[0][len(PROMPTS[2]) - 1 :]
        torch.testing.assert_close(torch.tensor(sequence.logprobs), expected, rtol=0, atol=1e-5)


def test_truncated_logprobs_are_renormalized_over_the_kept_tokens(model):
    engine = _engine(model)
    params = SamplingParams(max_tokens=6, temperature=0.8, top_k=5, top_p=0.9, seed=2)
    prompt = PROMPTS[0]
    (sequence,) = engine.sample(prompt, params).sequences
    tokens = torch.tensor([prompt + sequence.tokens])
    with torch.no_grad():
        logits_TV = model(tokens)[0, len(prompt) - 1 : -1].float() / 0.8
    for step, (token, logprob) in enumerate(zip(sequence.tokens, sequence.logprobs, strict=True)):
        probs_V = logits_TV[step].softmax(-1)
        top_V = probs_V.topk(5)
        keep, mass = [], 0.0
        # top-p applies to the top-k distribution, renormalized.
        renormalized = (top_V.values / top_V.values.sum()).tolist()
        for p, i in zip(renormalized, top_V.indices.tolist(), strict=True):
            if mass >= 0.9:
                break
            keep.append(i)
            mass += p
        assert token in keep
        expected = torch.log(probs_V[token] / probs_V[keep].sum())
        assert logprob == pytest.approx(expected.item(), abs=1e-5)


def test_score_is_bitwise_the_trainer_logprob_function(model):
    engine = _engine(model)
    sequences = [[1, 2, 3, 4, 5, 6], [7, 8, 9]]
    scored = engine.score(sequences)
    tokens_BT = torch.tensor([[1, 2, 3, 4, 5, 6], [7, 8, 9, 0, 0, 0]])
    with torch.no_grad():
        expected_BT = forward_logprobs(model, tokens_BT[:, :-1], tokens_BT[:, 1:])
    assert torch.equal(scored[0], expected_BT[0])
    assert torch.equal(scored[1], expected_BT[1, :2])


def test_seeded_samples_do_not_depend_on_the_batch(model):
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=1234)
    alone = _engine(model, max_batch=2).sample(PROMPTS[3], params, num_samples=3)
    crowd = [
        SampleRequest(prompt=PROMPTS[0], params=SamplingParams(max_tokens=7, temperature=0.5)),
        SampleRequest(prompt=PROMPTS[3], params=params, num_samples=3),
        SampleRequest(prompt=PROMPTS[2], params=SamplingParams(max_tokens=3, top_k=4, seed=9)),
    ]
    in_crowd = _engine(model, max_batch=8).generate(crowd)[1]
    assert [s.tokens for s in alone.sequences] == [s.tokens for s in in_crowd.sequences]
    for a, b in zip(alone.sequences, in_crowd.sequences, strict=True):
        torch.testing.assert_close(
            torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0
        )
    assert len({tuple(s.tokens) for s in alone.sequences}) == 3  # samples differ from each other


def test_more_samples_than_slots_share_one_prefill(model, monkeypatch):
    engine = _engine(model, max_batch=2)
    prefills = []
    original = engine.admission._prefill
    monkeypatch.setattr(
        engine.admission, "_prefill", lambda rows: (prefills.append(len(rows)), original(rows))
    )
    params = SamplingParams(max_tokens=5, temperature=0)
    response = engine.sample(PROMPTS[2], params, num_samples=5)
    assert prefills == [1]
    expected = greedy_decode(model, [PROMPTS[2]], max_new_tokens=5)[0]
    assert all(sequence.tokens == expected for sequence in response.sequences)


def test_stop_token_ids_eos_and_empty_stop():
    tokenizer = build_builtin_tokenizer("letters")
    model = _model(vocab_size=tokenizer.vocab_size)
    engine = SamplerEngine.Config(max_batch=4, max_seq_len=64, cpu=ONE_PROCESS).build(
        model=model, tokenizer=tokenizer
    )
    prompt = tokenizer.encode("hello")
    free = engine.sample(prompt, SamplingParams(max_tokens=20, temperature=0, stop=[]))
    tokens = free.sequences[0].tokens
    assert len(tokens) == 20 and free.sequences[0].stop_reason == "length"

    stop_token = tokens[4]
    first = tokens.index(stop_token)
    stopped = engine.sample(prompt, SamplingParams(max_tokens=20, temperature=0, stop=[stop_token]))
    assert stopped.sequences[0].tokens == tokens[: first + 1]
    assert stopped.sequences[0].stop_reason == "stop"

    eos_engine = SamplerEngine.Config(max_batch=4, max_seq_len=64, cpu=ONE_PROCESS).build(
        model=model, tokenizer=dataclasses.replace(_FakeEos(), eos_token_id=stop_token)
    )
    at_eos = eos_engine.sample(prompt, SamplingParams(max_tokens=20, temperature=0))
    assert at_eos.sequences[0].tokens == tokens[: first + 1]
    no_eos = eos_engine.sample(prompt, SamplingParams(max_tokens=20, temperature=0, stop=[]))
    assert no_eos.sequences[0].tokens == tokens


@dataclasses.dataclass
class _FakeEos:
    eos_token_id: int = 0


def test_stop_string_spanning_tokens_is_included_and_ends_generation():
    tokenizer = build_builtin_tokenizer("letters")
    model = _model(vocab_size=tokenizer.vocab_size, seed=8)
    engine = SamplerEngine.Config(max_batch=4, max_seq_len=64, cpu=ONE_PROCESS).build(
        model=model, tokenizer=tokenizer
    )
    prompt = tokenizer.encode("Once")
    params = SamplingParams(max_tokens=24, temperature=0, stop=[])
    text = tokenizer.decode(engine.sample(prompt, params).sequences[0].tokens)
    stop = text[5:8]  # three one-character tokens
    first = text.index(stop)
    stopped = engine.sample(prompt, dataclasses.replace(params, stop=["zzzz", stop]))
    (sequence,) = stopped.sequences
    assert tokenizer.decode(sequence.tokens) == text[: first + len(stop)]
    assert sequence.stop_reason == "stop"


def test_prompt_and_topk_logprobs(model):
    engine = _engine(model)
    prompt = PROMPTS[2]
    response = engine.sample(
        prompt,
        SamplingParams(max_tokens=4, temperature=1.0, seed=0),
        prompt_logprobs=True,
        topk_prompt_logprobs=3,
        topk_sample_logprobs=2,
    )
    assert response.prompt_logprobs[0] is None
    expected = engine.score([prompt])[0].tolist()
    assert response.prompt_logprobs[1:] == pytest.approx(expected, abs=1e-5)
    assert response.topk_prompt_logprobs[0] is None
    for position, alternatives in enumerate(response.topk_prompt_logprobs[1:], start=1):
        assert len(alternatives) == 3
        values = [value for _, value in alternatives]
        assert values == sorted(values, reverse=True)
        assert alternatives[0][1] >= response.prompt_logprobs[position] - 1e-5
    (sequence,) = response.sequences
    assert len(sequence.topk_logprobs) == len(sequence.tokens) == 4
    for token, logprob, alternatives in zip(
        sequence.tokens, sequence.logprobs, sequence.topk_logprobs, strict=True
    ):
        assert len(alternatives) == 2 and alternatives[0][1] >= logprob - 1e-6
        if token in [t for t, _ in alternatives]:
            assert dict(alternatives)[token] == pytest.approx(logprob, abs=1e-6)


def test_weight_updates_use_the_module_in_place_and_keep_the_cache(model):
    engine = _engine(model)
    cache_pointer = engine.cache.k_LSKCH.data_ptr()
    trained = _model(seed=99)
    engine.update_weights(trained, version=3)
    assert engine.version == 3 and engine.model is trained  # same dtype: no copy
    (sequence,) = engine.sample(PROMPTS[0], SamplingParams(max_tokens=6, temperature=0)).sequences
    assert sequence.tokens == greedy_decode(trained, [PROMPTS[0]], max_new_tokens=6)[0]

    engine.update_weights(model.state_dict(), version=4)
    assert engine.model is not trained and engine.version == 4
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            trained.state_dict().values(), _model(seed=99).state_dict().values(), strict=True
        )
    ), "a state-dict update must not write into the trainer's module"
    (sequence,) = engine.sample(PROMPTS[0], SamplingParams(max_tokens=6, temperature=0)).sequences
    assert sequence.tokens == greedy_decode(model, [PROMPTS[0]], max_new_tokens=6)[0]
    assert engine.cache.k_LSKCH.data_ptr() == cache_pointer


def test_bad_weight_updates_are_explained(model):
    engine = _engine(model)
    with pytest.raises(ValueError, match="does not match the sampler's model config"):
        engine.update_weights(_model(vocab_size=40), version=1)
    state_dict = dict(model.state_dict())
    state_dict["norm.weight"] = torch.ones(7)
    with pytest.raises(ValueError, match=r"'norm.weight' has shape \(7,\)"):
        engine.update_weights(state_dict, version=1)
    del state_dict["norm.weight"]
    with pytest.raises(ValueError, match=r"missing \['norm.weight'\]"):
        engine.update_weights(state_dict, version=1)


def test_bf16_engine_logprobs_track_its_own_scoring():
    model = _model(dtype="bfloat16")
    engine = _engine(model)
    assert engine.cache.k_LSKCH.dtype == torch.bfloat16
    (sequence,) = engine.sample(PROMPTS[2], SamplingParams(max_tokens=8, seed=4)).sequences
    expected = engine.score([PROMPTS[2] + sequence.tokens])[0][len(PROMPTS[2]) - 1 :]
    torch.testing.assert_close(torch.tensor(sequence.logprobs), expected, rtol=0, atol=0.15)


def test_cache_memory_is_known_up_front(model):
    config = SamplerEngine.Config(max_batch=16, max_seq_len=128, cpu=ONE_PROCESS)
    expected = config.kv_cache_bytes(model.config, dtype=torch.float32)
    # 2 (k and v) x 4 layers x 16 slots x 2 kv heads x 128 positions x 32 dims x 4 bytes
    assert expected == 2 * 4 * 16 * 2 * 128 * 32 * 4
    assert config.build(model=model).cache.nbytes == expected


@pytest.mark.parametrize(
    ("request_kwargs", "message"),
    [
        (
            {"prompt": [1, VOCAB]},
            rf"token {VOCAB} at position 1 is outside the vocabulary; valid ids are 0..{VOCAB - 1}",
        ),
        ({"prompt": [-1]}, "outside the vocabulary"),
        ({"prompt": []}, "prompt is empty"),
        (
            {"prompt": list(range(5)) * 20},
            r"prompt has 100 tokens; the sampler \(max_seq_len\) holds at most 96 tokens "
            r"\(prompt \+ completion\), so a prompt may have at most 95",
        ),
        ({"prompt": [1], "num_samples": 0}, "num_samples must be >= 1"),
        ({"prompt": [1], "topk_sample_logprobs": -1}, "topk_sample_logprobs must be in"),
        ({"prompt": [1], "params": SamplingParams(stop=[99])}, "stop token id 99 is outside"),
        ({"prompt": [1], "params": SamplingParams(stop="x")}, "stop strings need a tokenizer"),
    ],
)
def test_bad_requests_are_named_and_the_engine_keeps_serving(model, request_kwargs, message):
    engine = _engine(model)
    good = SampleRequest(prompt=[1, 2], params=SamplingParams(max_tokens=3, temperature=0))
    with pytest.raises(ValueError, match=message):
        engine.generate([good, SampleRequest(**request_kwargs)])
    assert engine.slots.num_active == 0
    assert len(engine.generate([good])[0].sequences[0].tokens) == 3


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"max_tokens": 0}, r"max_tokens must be > 0"),
        ({"temperature": -0.5}, r"temperature must be a finite number >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -3}, r"top_k must be an int >= 1, or -1/0 for no limit"),
    ],
)
def test_bad_sampling_params_name_the_parameter_and_range(params, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**params)


def test_max_tokens_is_capped_by_the_context(model):
    engine = _engine(model, max_seq_len=16)
    (sequence,) = engine.sample([1] * 10, SamplingParams(temperature=0)).sequences
    assert len(sequence.tokens) == 6 and sequence.stop_reason == "length"


def test_static_decode_step_matches_the_eager_step(model):
    """The CUDA-graph step (rows padded to a bucket, full cache width) run eagerly on CPU."""
    from temper.sampler.cuda_graphs import CudaGraphDecoding, default_buckets

    assert default_buckets(48) == [1, 2, 4, 8, 16, 32, 48]
    engine = _engine(model, max_batch=8)
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[4]]
    params = SamplingParams(max_tokens=9, temperature=0)
    eager = engine.generate([SampleRequest(prompt=p, params=params) for p in prompts])
    engine.decoding = CudaGraphDecoding(
        engine.weights, cache=engine.cache, buckets=[1, 4, 8], capture=False
    )
    static = engine.generate([SampleRequest(prompt=p, params=params) for p in prompts])
    for a, b in zip(eager, static, strict=True):
        assert a.sequences[0].tokens == b.sequences[0].tokens
        torch.testing.assert_close(
            torch.tensor(a.sequences[0].logprobs),
            torch.tensor(b.sequences[0].logprobs),
            rtol=0,
            atol=1e-5,
        )


@pytest.mark.gpu
def test_cuda_graph_decode_matches_eager_on_gpu():
    model = _model().cuda()
    params = SamplingParams(max_tokens=12, temperature=0)
    requests = [SampleRequest(prompt=p, params=params) for p in PROMPTS]
    graphed = _engine(model, cuda_graphs="auto", max_batch=4)
    eager = _engine(model, cuda_graphs="off", max_batch=4)
    assert graphed.decoding.static is not None and graphed.decoding.static.graphs
    for a, b in zip(graphed.generate(requests), eager.generate(requests), strict=True):
        assert a.sequences[0].tokens == b.sequences[0].tokens
