"""A weight switch between decode steps (weight_switch.py): the tokens before it are those of a
run on the old weights alone, and the ones after it are computed by the new weights over the
keys and values the old weights left in the cache."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from temper.api import SamplingParams
from temper.models import materialize, qwen3_size
from temper.sampler.cpu.decoding import CpuDecoding
from temper.sampler.engine import SamplerEngine, SampleRequest
from temper.sampler.weight_switch import WeightSwitch

VOCAB = 31
PROMPT = [3, 4, 5, 9, 1]
SWITCH_AT = 4
"""The hook call that takes the new weights: tokens 1..4 are the old weights' (the first
turn of the loop prefills and decodes one step)."""
MAX_TOKENS = 12
PLAIN = CpuDecoding.Config(processes=1, fused_projections=False, packed_linear="off")


def _model(seed):
    config = dataclasses.replace(qwen3_size("tiny", vocab_size=VOCAB), init_std=0.1)
    return materialize(config, seed=seed).eval()


@pytest.fixture(scope="module")
def models():
    return _model(5), _model(6)


def _engine(model, *, cpu=None):
    """An engine on a private copy of `model`'s weights (version 0)."""
    copy = materialize(model.config, init="empty")
    engine = SamplerEngine.Config(
        max_batch=4, max_seq_len=64, cpu=cpu or CpuDecoding.Config(processes=1)
    ).build(model=copy)
    engine.update_weights(model.state_dict(), version=0)
    return engine


def _greedy(engine, prompt, max_tokens, *, num_samples=1):
    params = SamplingParams(max_tokens=max_tokens, temperature=0, stop=[])
    request = SampleRequest(prompt=prompt, params=params, num_samples=num_samples)
    return engine.generate([request])[0]


def _switching(engine, switch, new_weights):
    """The engine's hook, with the new weights offered just before hook call SWITCH_AT."""
    calls = [0]

    def hook(engine_):
        calls[0] += 1
        if calls[0] == SWITCH_AT:
            switch.offer(new_weights, version=1)
        return switch.between_steps(engine_)

    engine.between_steps = hook


@pytest.mark.parametrize("cpu", ["twins", "plain"])
def test_decode_continues_on_the_new_weights_over_the_old_cache(models, cpu):
    old, new = models
    engine = _engine(old, cpu=None if cpu == "twins" else PLAIN)
    switch = WeightSwitch()
    _switching(engine, switch, {k: v.clone() for k, v in new.state_dict().items()})
    switch.begin_call(version=0)
    (switched,) = switch.stamped([_greedy(engine, PROMPT, MAX_TOKENS, num_samples=2)])
    assert engine.version == 1 and switch.num_switches == 1
    assert [s.weight_versions for s in switched.sequences] == [(0, 1), (0, 1)]
    tokens = switched.sequences[0].tokens

    # Before the switch: a run on the old weights alone.
    alone = _greedy(_engine(old, cpu=PLAIN), PROMPT, MAX_TOKENS).sequences[0]
    assert tokens[:SWITCH_AT] == alone.tokens[:SWITCH_AT]
    assert tokens != alone.tokens, "the new weights change the continuation"

    # After it: the new weights over the old weights' keys/values. The reference puts them
    # there through the prefix cache: the old weights decode SWITCH_AT tokens (their cache
    # keeps the prompt and all but the last), the new weights are copied into the module in
    # place (no weights generation: the cache stays) and extend the prompt by those tokens.
    reference = _engine(old, cpu=PLAIN)
    head = _greedy(reference, PROMPT, SWITCH_AT).sequences[0]
    assert head.tokens == tokens[:SWITCH_AT]
    with torch.no_grad():
        for name, tensor in reference.model.state_dict().items():
            tensor.copy_(new.state_dict()[name])
    tail = _greedy(reference, [*PROMPT, *head.tokens], MAX_TOKENS - SWITCH_AT).sequences[0]
    assert reference.prefix_cache.nbytes > 0
    assert tokens[SWITCH_AT:] == tail.tokens
    torch.testing.assert_close(
        torch.tensor(switched.sequences[0].logprobs[SWITCH_AT:]),
        torch.tensor(tail.logprobs),
        atol=1e-4,
        rtol=1e-4,
    )


def test_an_offer_is_taken_whole_at_a_call_start_and_only_the_newest(models):
    old, new = models
    engine = _engine(old, cpu=PLAIN)
    switch = WeightSwitch()
    engine.between_steps = switch.between_steps
    switch.offer(old.state_dict(), version=1)
    switch.offer(new.state_dict(), version=2)  # replaces the first offer
    assert switch.take(engine) and engine.version == 2 and not switch.has_pending
    assert not switch.take(engine)
    switch.begin_call(version=engine.version)
    (response,) = switch.stamped([_greedy(engine, PROMPT, 3)])
    assert response.sequences[0].weight_versions == (2,)
    assert response.sequences[0].tokens == _greedy(_engine(new), PROMPT, 3).sequences[0].tokens
