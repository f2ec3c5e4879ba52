"""Target prompt logprobs (Tinker's `target_prompt_logprobs`) from the engine's prefill equal
log_softmax of a full forward of the model at the positions asked, whatever else shares the
prefill, however the positions are chunked; bad targets are refused before any work."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from temper import ModelInput, SamplingParams, ServiceClient
from temper.api import PromptTargets
from temper.models import materialize, qwen3_size
from temper.sampler import prompt_scoring
from temper.sampler.cpu.decoding import CpuDecoding
from temper.sampler.engine import SamplerEngine, SampleRequest

ONE_PROCESS = CpuDecoding.Config(processes=1)
"""The engine alone: these tests read its own state (cache, slots, decode path)."""

VOCAB = 31
ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0)


@pytest.fixture(scope="module")
def model():
    config = dataclasses.replace(qwen3_size("tiny", vocab_size=VOCAB), init_std=0.1)
    return materialize(config, seed=5, dtype="float32").eval()


@pytest.fixture(scope="module")
def engine(model):
    return SamplerEngine.Config(max_batch=8, max_seq_len=64, cpu=ONE_PROCESS).build(model=model)


def full_forward_logprobs(model, prompt) -> torch.Tensor:
    """[len(prompt), V]: row t is log p(. | prompt[:t + 1])."""
    with torch.no_grad():
        hidden_1TD = model.hidden_states(torch.tensor([prompt]))
        return model.logits(hidden_1TD)[0].float().log_softmax(dim=-1)


def expected_table(model, prompt, ids_RK: torch.Tensor) -> torch.Tensor:
    logprobs_TV = full_forward_logprobs(model, prompt)[: len(prompt) - 1]
    gathered_RK = logprobs_TV.gather(1, ids_RK.clamp(min=0))
    return torch.where(ids_RK >= 0, gathered_RK, 0.0)


def random_ids(prompt, *, width, generator) -> torch.Tensor:
    ids_RK = torch.randint(0, VOCAB, (len(prompt) - 1, width), generator=generator)
    ids_RK[torch.rand(ids_RK.shape, generator=generator) < 0.5] = -1
    ids_RK[0] = -1  # rows before the first naming an id are not scored
    ids_RK[-1, 0] = 7  # at least one id
    return ids_RK


def test_targets_equal_a_full_forward_for_prompts_prefilled_together(model, engine):
    generator = torch.Generator().manual_seed(0)
    prompts = [[3, 4, 5], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [30, 0], [2] * 20]
    tables = [random_ids(p, width=1 + i, generator=generator) for i, p in enumerate(prompts)]
    requests = [
        SampleRequest(
            prompt=prompt,
            params=ONE_TOKEN,
            num_samples=2,
            target_prompt_logprobs=PromptTargets.from_ids(ids_RK),
        )
        for prompt, ids_RK in zip(prompts, tables, strict=True)
    ]
    for prompt, ids_RK, response in zip(prompts, tables, engine.generate(requests), strict=True):
        answer = response.target_prompt_logprobs
        assert answer.shape == tuple(ids_RK.shape)
        torch.testing.assert_close(
            answer.to_torch(), expected_table(model, prompt, ids_RK), atol=1e-5, rtol=0
        )
        assert response.prompt_logprobs is None  # only what was asked


def test_chunked_positions_and_repeated_ids_give_the_same_answer(model, engine, monkeypatch):
    prompt = list(range(1, 25))
    ids_RK = torch.arange(len(prompt) - 1)[:, None].repeat(1, 3) % VOCAB
    ids_RK[:, 2] = ids_RK[:, 0]  # the same id twice in a row
    targets = PromptTargets.from_ids(ids_RK)
    whole = engine.sample(prompt, ONE_TOKEN, target_prompt_logprobs=targets)
    monkeypatch.setattr(prompt_scoring, "DEFAULT_CHUNK_BYTES", 5 * VOCAB * 4)  # 5 rows a chunk
    chunked = engine.sample(prompt, ONE_TOKEN, target_prompt_logprobs=targets)
    table = whole.target_prompt_logprobs.to_torch()
    # (matmuls of other row counts may round differently: close, not bitwise)
    torch.testing.assert_close(chunked.target_prompt_logprobs.to_torch(), table, atol=1e-6, rtol=0)
    assert torch.equal(table[:, 0], table[:, 2])
    torch.testing.assert_close(table, expected_table(model, prompt, ids_RK), atol=1e-5, rtol=0)


def test_prompt_logprobs_and_targets_agree(engine):
    prompt = [4, 8, 15, 16, 23, 29]
    targets = PromptTargets.from_ids(torch.tensor(prompt[1:])[:, None])  # the prompt's own ids
    response = engine.sample(
        prompt, ONE_TOKEN, prompt_logprobs=True, target_prompt_logprobs=targets
    )
    own = response.target_prompt_logprobs.to_torch()[:, 0].tolist()
    assert own == pytest.approx(response.prompt_logprobs[1:], abs=1e-6)


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([[1], [2]], "must have len(prompt) - 1 = 3 rows (row i scores prompt position i + 1)"),
        ([[-1], [-1], [-1]], "names no token id; name at least one"),
        ([[1], [VOCAB], [-1]], f"token id {VOCAB} is outside the vocabulary; valid ids are 0.."),
        ([[1], [-2], [-1]], "token id -2 is outside the vocabulary"),
        ([[1] * (VOCAB + 1)] * 3, f"at most vocab_size = {VOCAB}, the bound on topk_prompt"),
    ],
)
def test_bad_targets_are_refused_before_any_work(engine, ids, message):
    prompt = [1, 2, 3, 4]
    good = SampleRequest(prompt=prompt, params=ONE_TOKEN)
    bad = SampleRequest(
        prompt=prompt, params=ONE_TOKEN, target_prompt_logprobs=PromptTargets.from_ids(ids)
    )
    with pytest.raises(ValueError, match="request 1: target_prompt_logprobs") as error:
        engine.generate([good, bad])
    assert message in str(error.value)
    assert engine.slots.num_active == 0
    assert engine.generate([good])[0].sequences[0].tokens


def test_targets_that_are_not_an_int_table_are_type_errors():
    with pytest.raises(TypeError, match="must hold int64 token ids, got float32"):
        PromptTargets.from_ids(torch.zeros(3, 2))
    with pytest.raises(ValueError, match=r"must be 2-D, \[len\(prompt\) - 1, K\], got shape \[3\]"):
        PromptTargets.from_ids([1, 2, 3])


def test_in_process_sampling_client_takes_a_dense_table(tmp_path):
    service = ServiceClient(storage_dir=tmp_path)
    sampler = service.create_sampling_client(base_model="tiny")
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    ids_RK = torch.full((len(prompt) - 1, 2), -1)
    ids_RK[5] = torch.tensor([2, 7])
    response = sampler.sample(
        ModelInput.from_ints(prompt), 1, ONE_TOKEN, target_prompt_logprobs=ids_RK
    ).result()
    model = sampler.generator.model
    expected = expected_table(model, prompt, ids_RK)
    torch.testing.assert_close(
        response.target_prompt_logprobs.to_torch(), expected, atol=1e-5, rtol=0
    )


def test_a_tinker_sdk_sparse_table_is_taken_as_its_cells():
    tinker_types = pytest.importorskip("tinker.types")
    ids_RK = torch.full((6, 4), -1)
    ids_RK[2, 1], ids_RK[4, 3] = 0, 9  # 0 is a real id, not the CSR's implicit value
    sparse = tinker_types.TensorData.from_torch_sparse(ids_RK, pad_value=-1)
    assert sparse.sparse_crow_indices is not None
    targets = PromptTargets.from_ids(sparse)
    assert targets == PromptTargets.from_ids(ids_RK)
    assert torch.equal(targets.to_torch(), ids_RK)
