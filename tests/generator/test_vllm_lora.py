"""VllmMultiLora (generator/vllm_lora.py): many LoRA adapters on one vLLM engine (vLLM's CPU
build, punica's torch ops), rows of different adapters in one vLLM batch.

Each adapter's rows equal its merged model's full forward (greedy tokens, logprobs within
1e-5 in fp32); a new version gets a fresh vLLM name, so cached prefix blocks of the old one
are never reused; an adapter vLLM dropped is reloaded from its file; a forgotten version
leaves vLLM and disk; a failed load keeps the previous version serving; capacity errors
name the setting; a tensor-parallel engine loads each adapter on both its workers. `make
test-vllm` runs these."""

from __future__ import annotations

import copy
import gc
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from temper.api import SamplingParams
from temper.generator.multi_lora import AdapterCapacityError, AdapterView, MultiLoraSampler
from temper.models.lora import LoraConfig, apply_lora
from temper.sampler.engine import SampleRequest
from tests.models.test_multi_lora import trained_adapters

pytest.importorskip("vllm", reason="the vllm extra is not installed (make vllm)")
pytestmark = pytest.mark.vllm

from temper.generator.vllm import VllmGenerator  # noqa: E402
from temper.generator.vllm_lora import VllmMultiLora  # noqa: E402

ROOT = Path(__file__).parents[2]
TOLERANCE = 1e-5  # fp32: KV-cache decode vs a full forward
CONFIGS = [
    LoraConfig(rank=2, seed=1),
    LoraConfig(rank=4, seed=2, train_unembed=False),
    LoraConfig(rank=8, seed=3, train_mlp=False, alpha=8.0),
    LoraConfig(rank=4, seed=4, train_attn=False),
]
MAX_ADAPTERS = 8
PROMPTS = [[3, 4, 5], [7], [1, 2, 3, 4], [9, 9, 2, 5, 1], [2, 2]]
# Several of vLLM's KV blocks, whose prefix vLLM caches (a 40-token prompt fills no block on
# vLLM's CPU build and is never cached): with a reused adapter name and path the second
# version's rows read the first one's cached blocks, and the test below fails.
LONG_PROMPT = [(7 * i + 3) % 31 for i in range(300)]


@pytest.fixture(scope="module")
def setup():
    """(the sampler: 2 adapters per step, at most MAX_ADAPTERS live; adapters; merged)."""
    base, adapters, merged = trained_adapters(CONFIGS)
    sampler = VllmMultiLora(
        MultiLoraSampler.Config(max_resident_adapters=2, max_adapters=MAX_ADAPTERS),
        model=base,
        tokenizer=None,
        vllm=VllmGenerator.Config(kv_cache_mib=64, max_lora_rank=8, max_num_seqs=16),
    )
    yield sampler, adapters, merged
    sampler.close()


def _greedy_reference(model, prompt, *, max_tokens):
    """Greedy tokens and their logprobs from full forwards of `model`."""
    sequence, logprobs = list(prompt), []
    with torch.no_grad():
        for _ in range(max_tokens):
            logprobs_V = model(torch.tensor([sequence]))[0, -1].float().log_softmax(-1)
            token = int(logprobs_V.argmax())
            sequence.append(token)
            logprobs.append(float(logprobs_V[token]))
    return sequence[len(prompt) :], logprobs


def _greedy(prompts, *, max_tokens=8):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=[])
    return [SampleRequest(prompt=prompt, params=params) for prompt in prompts]


def _assert_matches_merged(responses, prompts, model, *, max_tokens=8):
    for response, prompt in zip(responses, prompts, strict=True):
        tokens, logprobs = _greedy_reference(model, prompt, max_tokens=max_tokens)
        (sequence,) = response.sequences
        assert sequence.tokens == tokens
        torch.testing.assert_close(
            torch.tensor(sequence.logprobs), torch.tensor(logprobs), atol=TOLERANCE, rtol=0
        )


def _concurrently(sampler, calls):
    """Each (requests, adapter) call from its own thread, released together."""
    results = [None] * len(calls)
    barrier = threading.Barrier(len(calls))

    def run(index, requests, adapter):
        barrier.wait()
        results[index] = sampler.generate(requests, adapter=adapter)

    threads = [threading.Thread(target=run, args=(i, *call)) for i, call in enumerate(calls)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def test_mixed_adapters_in_one_batch_equal_each_merged_model(setup):
    sampler, adapters, merged = setup
    held = [sampler.register(config=c, tensors=t, version=i) for i, (c, t) in enumerate(adapters)]
    # One vLLM generate with rows of four adapters (two per step: vLLM schedules the rest).
    prompts = PROMPTS[:4]
    mixed = sampler.engine.generate(_greedy(prompts), adapters=[a.request for a in held])
    for who, response in enumerate(mixed):
        _assert_matches_merged([response], [prompts[who]], merged[who])
    # Calls of several clients at once share vLLM batches and get their own rows back.
    batches_before = sampler.num_batches
    calls = [(_greedy(PROMPTS[who : who + 2]), adapter) for who, adapter in enumerate(held)]
    together = _concurrently(sampler, calls)
    assert sampler.num_batches - batches_before < len(held)
    for who, responses in enumerate(together):
        _assert_matches_merged(responses, PROMPTS[who : who + 2], merged[who])


def test_scoring_uses_the_adapter(setup):
    sampler, adapters, merged = setup
    sequence = [1, 2, 3, 4, 5, 6]
    for who, (config, tensors) in enumerate(adapters):
        adapter = sampler.register(config=config, tensors=tensors, version=0)
        (ours,) = sampler.score([sequence], adapter=adapter)
        with torch.no_grad():
            logprobs_TV = merged[who](torch.tensor([sequence]))[0, :-1].log_softmax(-1)
        theirs = logprobs_TV.gather(-1, torch.tensor(sequence[1:])[:, None])[:, 0]
        torch.testing.assert_close(ours.float(), theirs, atol=TOLERANCE, rtol=0)


def test_a_new_version_never_reads_the_old_versions_cached_prefix(setup):
    sampler, adapters, merged = setup
    config, tensors = adapters[0]
    view = AdapterView(sampler, config=config)
    view.update_weights(tensors, version=1)
    first = view.generate(_greedy([LONG_PROMPT], max_tokens=4))  # caches the prefix
    _assert_matches_merged(first, [LONG_PROMPT], merged[0], max_tokens=4)
    old_name = view.adapter.request.lora_name
    # Version 2: the same adapter with other tensors (B doubled): another model.
    doubled = {name: t * 2 if name.endswith("lora_B") else t for name, t in tensors.items()}
    view.update_weights(doubled, version=2)
    assert view.adapter.request.lora_name != old_name
    second = view.generate(_greedy([LONG_PROMPT], max_tokens=4))
    _assert_matches_merged(second, [LONG_PROMPT], _lora_model(config, doubled), max_tokens=4)


def _lora_model(config, tensors):
    """A LoRA model on the test base with `tensors`: it computes what its merge does."""
    model = copy.deepcopy(trained_adapters([])[0])
    apply_lora(model, config)
    model.load_state_dict(tensors, strict=False)
    return model.eval()


def test_an_adapter_vllm_dropped_is_reloaded_from_its_file(setup):
    sampler, adapters, merged = setup
    config, tensors = adapters[2]
    adapter = sampler.register(config=config, tensors=tensors, version=0)
    # What vLLM's LRU over max_cpu_loras would do: the adapter leaves vLLM's caches.
    sampler.engine.remove_adapter(adapter.request.lora_int_id)
    responses = sampler.generate(_greedy(PROMPTS[:2]), adapter=adapter)
    _assert_matches_merged(responses, PROMPTS[:2], merged[2])


def test_a_forgotten_version_leaves_vllm_and_disk(setup):
    sampler, adapters, _ = setup
    config, tensors = adapters[0]
    adapter = sampler.register(config=config, tensors=tensors, version=0)
    directory = adapter.request.lora_path
    assert os.path.isdir(directory)
    del adapter
    gc.collect()
    keep = sampler.register(config=config, tensors=tensors, version=1)  # forgets first
    assert not os.path.exists(directory)
    assert os.path.isdir(keep.request.lora_path)


def test_a_failed_load_keeps_the_previous_version_serving(setup, monkeypatch):
    sampler, adapters, merged = setup
    config, tensors = adapters[0]
    view = AdapterView(sampler, config=config)
    view.update_weights(tensors, version=1)
    held = sampler.num_adapters
    wrong_shape = dict(tensors)
    name = next(iter(wrong_shape))
    wrong_shape[name] = torch.zeros(wrong_shape[name].shape[0] + 1, wrong_shape[name].shape[1])
    not_finite = {n: t.clone() for n, t in tensors.items()}
    not_finite[name][0, 0] = float("nan")
    too_wide = LoraConfig(rank=16, seed=1)
    for bad_config, bad, match in [
        (config, wrong_shape, "do not match a rank-2 LoRA"),
        (config, not_finite, "NaN or infinite"),
        (too_wide, tensors, "max_lora_rank"),
    ]:
        view.lora = bad_config
        with pytest.raises(ValueError, match=match):
            view.update_weights(bad, version=2)
    view.lora = config

    def refuse(request):
        raise RuntimeError("vLLM refused the adapter")

    monkeypatch.setattr(sampler.engine, "add_adapter", refuse)
    with pytest.raises(ValueError, match=r"could not load LoRA adapter version 2 .*refused"):
        view.update_weights(tensors, version=2)
    monkeypatch.undo()
    assert view.version == 1 and sampler.num_adapters == held
    _assert_matches_merged(view.generate(_greedy(PROMPTS[:1])), PROMPTS[:1], merged[0])
    leftovers = [p for p in os.listdir(os.path.dirname(view.adapter.request.lora_path))]
    assert len(leftovers) == sampler.num_adapters  # no directory of a failed version


def test_capacity_is_a_clear_error_and_dropped_versions_free_it(setup):
    sampler, adapters, _ = setup
    gc.collect()
    config, tensors = adapters[1]
    held = []
    while sampler.num_adapters < MAX_ADAPTERS:
        held.append(sampler.register(config=config, tensors=tensors, version=len(held)))
    with pytest.raises(AdapterCapacityError, match=f"max_adapters = {MAX_ADAPTERS}"):
        sampler.register(config=config, tensors=tensors, version=99)
    del held[0]
    gc.collect()
    held.append(sampler.register(config=config, tensors=tensors, version=100))  # room again


@pytest.mark.slow
def test_a_tensor_parallel_engine_loads_each_adapter_on_every_worker():
    """vLLM's own engine processes, two tensor-parallel workers: each adapter, read from its
    directory by both, gives its merged model's rows; one dropped is reloaded by both. In a
    process of its own: vLLM binds CPU workers from settings it reads once per process, so an
    in-process engine started earlier (this module's) would fix them."""
    code = (
        "from tests.generator.test_vllm_lora import check_tensor_parallel; check_tensor_parallel()"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        },
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "tensor-parallel adapters: ok" in result.stdout


def check_tensor_parallel() -> None:
    _, adapters, merged = trained_adapters(CONFIGS[:2])
    sampler = VllmMultiLora(
        MultiLoraSampler.Config(max_resident_adapters=2, max_adapters=4),
        model=trained_adapters([])[0],
        tokenizer=None,
        vllm=VllmGenerator.Config(
            kv_cache_mib=64,
            max_lora_rank=8,
            max_num_seqs=16,
            engine_process="separate",
            tensor_parallel_size=2,
        ),
    )
    try:
        held = [sampler.register(config=c, tensors=t, version=0) for c, t in adapters]
        mixed = sampler.engine.generate(_greedy(PROMPTS[:2]), adapters=[a.request for a in held])
        for who, response in enumerate(mixed):
            _assert_matches_merged([response], [PROMPTS[who]], merged[who])
        sampler.engine.remove_adapter(held[1].request.lora_int_id)
        again = sampler.generate(_greedy(PROMPTS[2:3]), adapter=held[1])
        _assert_matches_merged(again, PROMPTS[2:3], merged[1])
    finally:
        sampler.close()
    print("tensor-parallel adapters: ok")
