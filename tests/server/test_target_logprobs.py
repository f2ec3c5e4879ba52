"""`target_prompt_logprobs` through `temper serve` with the unmodified tinker SDK: dense and
sparse requests answer in their own layout with the logprobs a full forward of the model
gives; the cookbook's decisions recipe gets its distribution over labels; bad targets are a
400 naming the field, and the sampler keeps serving."""

from __future__ import annotations

import asyncio

import pytest
import tinker
import torch
from tinker import types

import temper
from tests.sampler.test_prompt_scoring import expected_table, full_forward_logprobs
from tests.server.test_bad_input import (
    assert_user_error,
    post,
    raw_sampling_session,
    sample_body,
)

ONE_TOKEN = types.SamplingParams(max_tokens=1, temperature=0.0)
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]


@pytest.fixture(scope="module")
def sampler(server, model_dir):
    service = server.service()
    yield service.create_sampling_client(base_model=str(model_dir)).result()
    service.close("success").result()


@pytest.fixture(scope="module")
def model(model_dir, tmp_path_factory):
    local = temper.ServiceClient(storage_dir=tmp_path_factory.mktemp("local"))
    return local.create_sampling_client(base_model=str(model_dir.resolve())).generator.model


def table(rows: dict[int, list[int]], *, width: int) -> torch.Tensor:
    ids_RK = torch.full((len(PROMPT) - 1, width), -1, dtype=torch.int64)
    for row, ids in rows.items():
        ids_RK[row, : len(ids)] = torch.tensor(ids)
    return ids_RK


def test_dense_and_sparse_targets_equal_a_full_forward(sampler, model):
    ids_RK = table({2: [4, 0, 7], 5: [9], 8: [1, 1, 2]}, width=3)
    expected = expected_table(model, PROMPT, ids_RK)
    prompt = types.ModelInput.from_ints(PROMPT)
    for request in (
        types.TensorData.from_torch(ids_RK),
        types.TensorData.from_torch_sparse(ids_RK, pad_value=-1),
    ):
        response = sampler.sample(prompt, 1, ONE_TOKEN, target_prompt_logprobs=request).result()
        answer = response.target_prompt_logprobs
        assert answer.dtype == "float32" and list(answer.shape) == list(ids_RK.shape)
        assert answer.sparse_crow_indices == request.sparse_crow_indices  # the same layout
        assert answer.sparse_col_indices == request.sparse_col_indices
        torch.testing.assert_close(answer.to_torch(), expected, atol=1e-5, rtol=0)
    assert request.sparse_crow_indices is not None  # (the second one really was sparse)


def test_targets_ignore_prompt_logprobs_last_n(sampler, model):
    ids_RK = table({0: [5], 1: [2, 8]}, width=2)  # rows before the last n = 2
    response = sampler.sample(
        types.ModelInput.from_ints(PROMPT),
        1,
        ONE_TOKEN,
        include_prompt_logprobs=True,
        target_prompt_logprobs=types.TensorData.from_torch_sparse(ids_RK, pad_value=-1),
        prompt_logprobs_last_n=2,
    ).result()
    assert response.prompt_logprobs[: len(PROMPT) - 2] == [None] * (len(PROMPT) - 2)
    torch.testing.assert_close(
        response.target_prompt_logprobs.to_torch(),
        expected_table(model, PROMPT, ids_RK),
        atol=1e-5,
        rtol=0,
    )


def test_cookbook_sample_decision_gets_the_full_forward_distribution(sampler, model):
    decision = pytest.importorskip("tinker_cookbook.recipes.decisions.decision")
    label_tokens = {"A": 11, "B": 12, "C": 13}
    rendering = decision.DecisionRendering(
        tokens=[*PROMPT, 0], choice_pos=len(PROMPT), label_tokens=label_tokens
    )
    probabilities = asyncio.run(decision.sample_decision(sampler, rendering))
    logprobs_V = full_forward_logprobs(model, rendering.tokens)[rendering.choice_pos - 1]
    expected = logprobs_V[list(label_tokens.values())].softmax(dim=0).tolist()
    assert list(probabilities) == ["A", "B", "C"]
    assert list(probabilities.values()) == pytest.approx(expected, abs=1e-5)


def wire_tensor(ids_RK: torch.Tensor, **overrides) -> dict:
    return {"data": ids_RK.flatten().tolist(), "dtype": "int64", "shape": list(ids_RK.shape)} | (
        overrides
    )


def test_bad_targets_are_400s_naming_the_field_and_the_sampler_keeps_serving(
    server, model_dir, sampler, model
):
    vocab = model.config.vocab_size
    session = raw_sampling_session(server, model_dir)
    tokens = [1, 2, 3, 4]
    good_RK = torch.tensor([[-1], [5], [-1]])

    def body(targets: dict) -> dict:
        return sample_body(session, tokens, target_prompt_logprobs=targets)

    cases = [
        (
            wire_tensor(good_RK.float(), dtype="float32"),
            "target_prompt_logprobs must be an int64 tensor of token ids, got float32",
        ),
        (wire_tensor(good_RK[:2]), "must have len(prompt) - 1 = 3 rows"),
        (wire_tensor(good_RK, shape=[3]), "must be 2-D, [len(prompt) - 1, K], got shape [3]"),
        (wire_tensor(good_RK, shape=[3, 2]), "target_prompt_logprobs: 3 values do not fill"),
        (wire_tensor(torch.full((3, 2), -1)), "target_prompt_logprobs names no token id"),
        (
            wire_tensor(good_RK + vocab + 1),
            f"target_prompt_logprobs: token id {vocab} is outside the vocabulary",
        ),
        (
            {"data": [5], "dtype": "int64", "shape": [3, vocab + 1]}
            | {"sparse_crow_indices": [0, 0, 1, 1], "sparse_col_indices": [vocab]},
            f"at most vocab_size = {vocab}, the bound on topk_prompt_logprobs",
        ),
        (
            {"data": [5], "dtype": "int64", "shape": [3, 2]}
            | {"sparse_crow_indices": [0, 1, 0, 1], "sparse_col_indices": [0]},
            "target_prompt_logprobs: inconsistent sparse CSR indices for shape [3, 2]",
        ),
    ]
    for targets, message in cases:
        assert_user_error(post(server, "asample", json=body(targets)), 400, message)

    prompt = types.ModelInput.from_ints(PROMPT)
    with pytest.raises(tinker.BadRequestError, match="target_prompt_logprobs must have"):
        sampler.sample(
            prompt, 1, ONE_TOKEN, target_prompt_logprobs=types.TensorData.from_torch(good_RK)
        ).result()
    answer = post(server, "asample", json=body(wire_tensor(good_RK)))
    assert answer.status_code == 200
    ids_RK = table({4: [6]}, width=1)
    response = sampler.sample(
        prompt, 1, ONE_TOKEN, target_prompt_logprobs=types.TensorData.from_torch(ids_RK)
    ).result()
    torch.testing.assert_close(
        response.target_prompt_logprobs.to_torch(),
        expected_table(model, PROMPT, ids_RK),
        atol=1e-5,
        rtol=0,
    )
