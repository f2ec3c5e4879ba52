"""The vLLM backend on a Qwen3-MoE model: vLLM loads what Temper exports under the HF names
(one tensor per expert), its greedy tokens and logprobs are Temper's, and a weight update
reaches its experts (with the workaround for vLLM-CPU's reload of MoE layers).

vLLM's CPU build runs the experts through its own fused MoE kernel (routing, the experts'
SwiGLU and the weighted sum in one op), so its numbers are not Temper's bit for bit; in fp32
they agree to about 2e-6 on the tiny model, inside the 1e-5 the dense families' tests use."""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch

from temper.api import SamplingParams
from temper.models import materialize, qwen3_moe_size
from temper.sampler.engine import SamplerEngine, SampleRequest
from temper.tokenizer import build_builtin_tokenizer

pytest.importorskip("vllm", reason="the vllm extra is not installed (make vllm)")
pytestmark = pytest.mark.vllm

from temper.generator import vllm_process, vllm_reload  # noqa: E402
from temper.generator.vllm import VllmGenerator  # noqa: E402

TOLERANCE = 1e-5  # fp32; vLLM's fused MoE kernel and Temper's per-expert matmuls round apart
PROMPTS = [[1, 5, 9, 3], [2, 7], [4, 4, 4, 8, 1, 6, 2] * 3]
GREEDY = SamplingParams(max_tokens=16, temperature=0, stop=[])


@pytest.fixture(autouse=True, scope="module")
def _no_dense_engine_left_running():
    """Engines an earlier test in this process left running (a client it never closed keeps
    its generator alive) hold vLLM's process-wide state as a dense model set it up, without
    the expert-parallel group a MoE engine needs (see
    `vllm_process.InlineEngines.check_can_start`): shut them down, as their owners are gone."""
    gc.collect()
    engines = VllmGenerator._inline_engines
    for llm in list(engines.running):
        engines.close(llm)


def _model(*, tied: bool):
    tokenizer = build_builtin_tokenizer("digits")
    # Logits of order 2 (init_std 0.1): distributions far from uniform, greedy outputs vary.
    # Layer 1 dense: vLLM builds a dense MLP there from mlp_only_layers, as Temper does.
    config = dataclasses.replace(
        qwen3_moe_size("tiny", vocab_size=tokenizer.vocab_size),
        init_std=0.1,
        tie_embeddings=tied,
        mlp_only_layers=(1,),
        max_seq_len=64,
    )
    return materialize(config, seed=5, dtype="float32").eval(), tokenizer


def _temper(model, tokenizer):
    return SamplerEngine.Config(max_batch=8, max_seq_len=64).build(model=model, tokenizer=tokenizer)


def _assert_agree(ours, theirs):
    for mine, other in zip(ours, theirs, strict=True):
        for a, b in zip(mine.sequences, other.sequences, strict=True):
            assert a.tokens == b.tokens
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < TOLERANCE


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_greedy_tokens_and_logprobs_agree_with_temper(tied):
    model, tokenizer = _model(tied=tied)
    vllm = VllmGenerator.Config(kv_cache_mib=64).build(model=model, tokenizer=tokenizer)
    try:
        requests = [SampleRequest(prompt=p, params=GREEDY) for p in PROMPTS]
        ours, theirs = _temper(model, tokenizer).generate(requests), vllm.generate(requests)
    finally:
        vllm.close()
    _assert_agree(ours, theirs)
    assert len({tuple(r.sequences[0].tokens) for r in ours}) > 1  # outputs really vary


def _experts_perturbed(model, *, seed: int) -> dict[str, torch.Tensor]:
    """The model's state with only its routers and experts moved."""
    generator = torch.Generator().manual_seed(seed)
    return {
        name: value + 0.1 * torch.randn(value.shape, generator=generator)
        if ".experts." in name or ".router." in name
        else value
        for name, value in model.state_dict().items()
    }


def test_an_update_of_the_experts_is_what_vllm_samples_from_next():
    """Expert weights travel as one HF tensor per expert (ModelFamily.tensors_to_hf): an
    update that changes only routers and experts moves vLLM's results to Temper's."""
    model, tokenizer = _model(tied=True)
    vllm = VllmGenerator.Config(kv_cache_mib=32).build(model=model, tokenizer=tokenizer)
    try:
        request = [SampleRequest(prompt=PROMPTS[2], params=GREEDY, prompt_logprobs=True)]
        vllm.generate(request)  # the prompt's keys/values are now in vLLM's prefix cache
        for version, form in enumerate(["state dict", "stream"], start=1):
            before = vllm.score([PROMPTS[2]])[0]
            state = _experts_perturbed(model, seed=version)
            model.load_state_dict(state)
            vllm.update_weights(
                state if form == "state dict" else iter(state.items()), version=version
            )
            (ours,), (theirs,) = _temper(model, tokenizer).generate(request), vllm.generate(request)
            assert vllm.version == version
            _assert_agree([ours], [theirs])
            prompt_diffs = [
                abs(a - b)
                for a, b in zip(ours.prompt_logprobs[1:], theirs.prompt_logprobs[1:], strict=True)
            ]
            assert max(prompt_diffs) < TOLERANCE
            # The experts' update mattered: the old weights' logprobs are far from the new.
            assert (before - vllm.score([PROMPTS[2]])[0]).abs().max() > 1e-2
    finally:
        vllm.close()


def test_without_the_moe_reload_workaround_vllm_reads_unpacked_experts(monkeypatch):
    """vLLM-CPU's reload copies a MoE layer's new expert weights in without prepacking them
    for its CPU kernel, even when the weights are unchanged; this is the test that fails if
    `vllm_reload.refresh_moe_experts` stops being called (or needed)."""
    model, tokenizer = _model(tied=False)
    vllm = VllmGenerator.Config(kv_cache_mib=32).build(model=model, tokenizer=tokenizer)
    try:
        reference = _temper(model, tokenizer).score([PROMPTS[2]])[0]
        monkeypatch.setattr(vllm_reload, "refresh_moe_experts", lambda model: None)
        vllm.update_weights(model.state_dict(), version=1)
        assert (vllm.score([PROMPTS[2]])[0] - reference).abs().max() > 1e-2
        monkeypatch.undo()
        vllm.update_weights(model.state_dict(), version=2)
        assert (vllm.score([PROMPTS[2]])[0] - reference).abs().max() < TOLERANCE
    finally:
        vllm.close()


def test_a_moe_engine_does_not_start_beside_a_running_dense_one():
    # vLLM's process-wide state is set up by the first engine; a dense model's has no
    # expert-parallel group. Stand-in engines: only the bookkeeping is under test.
    engines = vllm_process.InlineEngines()
    dense = object()
    engines.add(dense, moe=False)
    engines.check_can_start(moe=False)
    with pytest.raises(ValueError, match=r"MoE model's vLLM engine cannot start .* 1 dense"):
        engines.check_can_start(moe=True)
    engines.running.remove(dense)  # as its shutdown at close would
    engines.check_can_start(moe=True)
    engines.add(object(), moe=True)
    engines.add(object(), moe=False)
    engines.check_can_start(moe=True)  # a MoE engine set the state up: it has the group
