"""Shared-prefix packing: clustering, the packed layout's budget, and results equal to the
padded path (logprobs, losses and gradients), for full fine-tuning and LoRA."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from temper.api import Datum, ModelInput
from temper.models import materialize, qwen3_size
from temper.trainer import LoraConfig, TrainerEngine
from temper.trainer.inputs import micro_batches, prepare
from temper.trainer.shared_prefix import cluster_prefixes, packed_size

VOCAB = 29


def _engine(*, share: bool, max_tokens: int = 8192, lora: LoraConfig | None = None):
    config = dataclasses.replace(qwen3_size("tiny", vocab_size=VOCAB), init_std=0.1)
    engine_config = TrainerEngine.Config(max_tokens_per_microbatch=max_tokens, share_prefixes=share)
    return engine_config.build(model=materialize(config, seed=0), lora=lora)


def _grpo_data(*, groups: int = 5, group_size: int = 4, seed: int = 0) -> list[Datum]:
    """GRPO-shaped datums: each group's samples share a prompt (lengths 3..9), and the first
    two samples of a group also share their first completion token."""
    generator = torch.Generator().manual_seed(seed)
    data = []
    for group in range(groups):
        prompt = torch.randint(0, VOCAB, (3 + (group * 2) % 7,), generator=generator).tolist()
        first = int(torch.randint(0, VOCAB, (1,), generator=generator))
        for sample in range(group_size):
            length = 4 + (group + sample) % 4
            completion = torch.randint(0, VOCAB, (length,), generator=generator).tolist()
            if sample < 2:
                completion[0] = first
            tokens = prompt + completion
            n = len(tokens) - 1
            data.append(
                Datum(
                    model_input=ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={
                        "target_tokens": tokens[1:],
                        "logprobs": (-torch.rand(n, generator=generator) * 3).tolist(),
                        "advantages": torch.randn(n, generator=generator).tolist(),
                    },
                )
            )
    return data


def _prepared(data):
    return prepare(
        data,
        required=("target_tokens",),
        optional=("logprobs", "advantages"),
        vocab_size=VOCAB,
        max_seq_len=2048,
    )


def test_clusters_follow_groups_even_when_samples_share_completion_tokens():
    prompt_a, prompt_b = [1, 2, 3, 4], [1, 2, 9]
    tokens = [
        [*prompt_a, 5, 6],
        [*prompt_a, 5, 7],  # shares a completion token with the first
        [*prompt_a, 8, 8],
        [*prompt_b, 4, 4],  # shares [1, 2] with prompt_a only
        [*prompt_b, 5],
        [7, 7, 7],  # alone
    ]
    clusters = cluster_prefixes(tokens)
    assert [(c.members, c.prefix_len) for c in clusters] == [
        ([0, 1, 2], 4),
        ([3, 4], 3),
        ([5], 0),
    ]


def test_identical_datums_keep_a_suffix_token_each():
    clusters = cluster_prefixes([[3, 4, 5]] * 3)
    assert [(c.members, c.prefix_len) for c in clusters] == [([0, 1, 2], 2)]


def test_unrelated_datums_stay_padded_and_groups_pack_within_the_budget():
    unrelated = _prepared(
        [
            Datum(
                model_input=ModelInput.from_ints([i, i + 1, i + 2]),
                loss_fn_inputs={"target_tokens": [i + 1, i + 2, i + 3]},
            )
            for i in range(5)
        ]
    )
    batches = list(micro_batches(unrelated, max_tokens=64, share_prefixes=True))
    assert all(batch.layout is None for batch in batches)

    grouped = _prepared(_grpo_data(groups=6, group_size=8))
    budget = 48
    batches = list(micro_batches(grouped, max_tokens=budget, share_prefixes=True))
    assert all(batch.layout is not None for batch in batches)
    assert all(batch.layout.num_positions <= budget for batch in batches)
    assert [d.index for batch in batches for d in batch.datums] == list(range(len(grouped)))
    padded = next(iter(micro_batches(grouped, max_tokens=10**6)))
    packed = next(iter(micro_batches(grouped, max_tokens=10**6, share_prefixes=True)))
    assert packed.layout.num_positions < 0.75 * padded.tokens_BT.numel()


@pytest.mark.parametrize("lora", [None, LoraConfig(rank=4, alpha=8.0)], ids=["full", "lora"])
@pytest.mark.parametrize("max_tokens", [8192, 40], ids=["one-batch", "split-clusters"])
def test_packed_results_equal_the_padded_path(lora, max_tokens):
    data = _grpo_data()
    layouts = micro_batches(_prepared(data), max_tokens=max_tokens, share_prefixes=True)
    assert all(batch.layout is not None for batch in layouts)
    padded, packed = _engine(share=False, lora=lora), _engine(share=True, lora=lora)
    packed.config.max_tokens_per_microbatch = max_tokens
    expected = padded.forward_backward(data, "ppo")
    actual = packed.forward_backward(data, "ppo")
    for want, got in zip(expected.loss_fn_outputs, actual.loss_fn_outputs, strict=True):
        for name in ("logprobs", "elementwise_loss"):
            torch.testing.assert_close(
                got[name].to_torch(), want[name].to_torch(), rtol=0, atol=2e-5
            )
    assert actual.metrics["loss:sum"] == pytest.approx(expected.metrics["loss:sum"], rel=1e-5)
    for reference, parameter in zip(padded.trainable, packed.trainable, strict=True):
        scale = reference.grad.abs().max().item()
        assert (parameter.grad - reference.grad).abs().max().item() <= 1e-4 * scale


def test_packed_size_counts_prefix_and_suffix_rows():
    clusters = cluster_prefixes([[1, 2, 3, 4], [1, 2, 3, 5, 6], [9, 9]])
    # one prefix row of 3, one for the singleton (width 3, unused); suffixes up to 2 wide
    assert packed_size(clusters, [4, 5, 2]) == 2 * 3 + 3 * 2
