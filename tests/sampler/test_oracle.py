"""The oracle greedy decoder equals the argmax of a full forward at every step."""

from __future__ import annotations

import pytest
import torch

from temper.models import materialize, qwen3_size
from temper.sampler import greedy_decode


@pytest.fixture(scope="module")
def model():
    return materialize(qwen3_size("tiny", vocab_size=31), seed=5).eval()


def _argmax_continuation(model, prompt, steps):
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            tokens.append(int(model(torch.tensor([tokens]))[0, -1].argmax()))
    return tokens[len(prompt) :]


def test_batched_greedy_equals_one_at_a_time_argmax(model):
    prompts = [[3, 4, 5], [7], [1, 2, 3, 4, 5, 6, 7, 8], [9, 9]]
    completions = greedy_decode(model, prompts, max_new_tokens=6)
    for prompt, completion in zip(prompts, completions, strict=True):
        assert completion == _argmax_continuation(model, prompt, 6)


def test_stop_token_ends_a_row_and_is_included(model):
    prompt = [3, 4, 5]
    free = _argmax_continuation(model, prompt, 6)
    stop = free[2]
    first_stop = free.index(stop)
    (completion,) = greedy_decode(model, [prompt], max_new_tokens=6, stop_token_ids=[stop])
    assert completion == free[: first_stop + 1]


def test_bad_arguments(model):
    with pytest.raises(ValueError, match="max_new_tokens must be > 0"):
        greedy_decode(model, [[1]], max_new_tokens=0)
    with pytest.raises(ValueError, match="at least one token"):
        greedy_decode(model, [[]], max_new_tokens=1)
