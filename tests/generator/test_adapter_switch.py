"""An in-flight adapter switch on the multi-LoRA sampler (generator/multi_lora.py): between two
decode steps a following call's rows move to a newer adapter version. The tokens before the
switch are the old adapter's alone; the ones after it are the new adapter's over the keys and
values the old one left in the cache; another call on the old adapter keeps it throughout."""

from __future__ import annotations

import copy

import pytest
import torch

from temper.api import SamplingParams
from temper.generator.multi_lora import AdapterView, MultiLoraSampler
from temper.models.lora import LoraConfig
from temper.models.multi_lora import load_adapter
from temper.sampler.engine import SamplerEngine, SampleRequest
from temper.sampler.weight_switch import WeightSwitch
from tests.models.test_multi_lora import trained_adapters
from tests.sampler.test_decode_loop import JoinAtStep

LORA = LoraConfig(rank=4, seed=1)
ENGINE = SamplerEngine.Config(max_batch=8, max_seq_len=64)
PROMPT = [3, 4, 5, 9, 1]
SWITCH_AT = 4
"""Tokens the following call decodes with the old adapter."""
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def base_and_adapters():
    """The frozen base and two versions of one adapter (the same config, other tensors)."""
    base, adapters, _ = trained_adapters([LORA, LORA])
    return base, [tensors for _, tensors in adapters]


def _sampler(base):
    return MultiLoraSampler.Config().build(model=copy.deepcopy(base), tokenizer=None, engine=ENGINE)


def _greedy(prompt, max_tokens, *, num_samples=1):
    params = SamplingParams(max_tokens=max_tokens, temperature=0, stop=[])
    return [SampleRequest(prompt=prompt, params=params, num_samples=num_samples)]


def _alone(base, tensors, prompt, max_tokens):
    sampler = _sampler(base)
    adapter = sampler.register(config=LORA, tensors=tensors, version=0)
    return sampler.generate(_greedy(prompt, max_tokens), adapter=adapter)[0].sequences[0]


@pytest.mark.parametrize("where", ["in_place", "other_slot"])
def test_a_following_call_goes_on_with_the_new_adapter_over_the_old_cache(base_and_adapters, where):
    base, (old, new) = base_and_adapters
    sampler = _sampler(base)
    view = AdapterView(sampler, config=LORA)
    view.switch = switch = WeightSwitch()
    view.update_weights(old, version=0)
    old_adapter = view.adapter
    newer = view.registered(new, version=1)
    # In place: the following call alone holds its slot. Other slot: a call on the same
    # adapter (no switch of its own) runs beside it, so the slot stays the old adapter's.
    offer_at = SWITCH_AT if where == "in_place" else SWITCH_AT + 1  # it joins at step 2
    calls = [0]
    take_offers = sampler.engine.between_steps

    def hook(engine):
        calls[0] += 1
        if calls[0] == offer_at:
            switch.offer(newer, version=1)
        return take_offers(engine)

    sampler.engine.between_steps = hook
    switch.begin_call(version=0)

    def following():
        requests = _greedy(PROMPT, MAX_TOKENS, num_samples=2)
        return switch.stamped(sampler.generate(requests, adapter=old_adapter, follow=view))[0]

    if where == "in_place":
        switched = following()
    else:
        beside = _greedy([7, 2, 2], 20)
        joining = JoinAtStep(sampler.engine, at=0)
        other, switched = joining.run(
            lambda: sampler.generate(beside, adapter=old_adapter), following
        )
        alone = _alone(base, old, [7, 2, 2], 20)
        assert other[0].sequences[0].tokens == alone.tokens
        torch.testing.assert_close(
            torch.tensor(other[0].sequences[0].logprobs), torch.tensor(alone.logprobs)
        )
    assert switch.num_switches == 1 and view.adapter is newer.adapter and view.version == 1
    assert [s.weight_versions for s in switched.sequences] == [(0, 1), (0, 1)]
    tokens = switched.sequences[0].tokens
    assert switched.sequences[1].tokens == tokens

    # Before the switch: the old adapter alone.
    alone = _alone(base, old, PROMPT, MAX_TOKENS)
    assert tokens[:SWITCH_AT] == alone.tokens[:SWITCH_AT]
    assert tokens != alone.tokens, "the new adapter changes the continuation"

    # After it: the new adapter over the old one's keys/values. The reference puts them there
    # through the prefix cache: the old adapter decodes SWITCH_AT tokens, the new one is
    # loaded into its slot without forgetting the slot's cached prefixes, and extends the
    # prompt by those tokens.
    reference = _sampler(base)
    adapter = reference.register(config=LORA, tensors=old, version=0)
    head = reference.generate(_greedy(PROMPT, SWITCH_AT), adapter=adapter)[0].sequences[0]
    assert head.tokens == tokens[:SWITCH_AT]
    with torch.inference_mode():  # as between decode steps: the slots are inference tensors
        load_adapter(reference.engine.model, 0, config=LORA, tensors=new)
    turn = [*PROMPT, *head.tokens]
    hits = reference.engine.prefix_cache.num_hits
    tail = reference.generate(_greedy(turn, MAX_TOKENS - SWITCH_AT), adapter=adapter)
    assert reference.engine.prefix_cache.num_hits == hits + 1
    assert tokens[SWITCH_AT:] == tail[0].sequences[0].tokens
    torch.testing.assert_close(
        torch.tensor(switched.sequences[0].logprobs[SWITCH_AT:]),
        torch.tensor(tail[0].sequences[0].logprobs),
        atol=1e-4,
        rtol=1e-4,
    )

    # In place the old version left its slot; beside another call it kept it.
    loads = sampler.num_loads
    sampler.generate(_greedy(PROMPT, 2), adapter=old_adapter)
    assert sampler.num_loads == loads + (1 if where == "in_place" else 0)


def test_an_offer_waits_at_the_call_start_for_a_view_without_decoding(base_and_adapters):
    """Taken whole before a call (`WeightSwitch.take`): a registered version is adopted."""
    base, (old, new) = base_and_adapters
    sampler = _sampler(base)
    view = AdapterView(sampler, config=LORA)
    view.switch = switch = WeightSwitch()
    view.update_weights(old, version=0)
    switch.offer(view.registered(new, version=3), version=3)
    assert switch.take(view) and view.version == 3
    tokens = view.generate(_greedy(PROMPT, 4))[0].sequences[0].tokens
    assert tokens == _alone(base, new, PROMPT, 4).tokens
