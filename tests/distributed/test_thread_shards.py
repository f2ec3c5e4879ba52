"""Shards of a call on CPU threads (TrainerEngine.Config.shard_threads): the split, the
workers' thread counts, and an engine whose results match the one-thread engine's, are the
same on every run, and survive a failed call unchanged."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from temper.api import AdamParams, Datum, ModelInput
from temper.distributed.thread_shards import ThreadShards, split_by_tokens, sum_gradients
from temper.models import materialize, qwen3_size
from temper.trainer import LoraConfig, TrainerEngine

VOCAB = 31


def _engine(*, shard_threads: int, max_tokens: int = 8192, lora: LoraConfig | None = None):
    config = dataclasses.replace(qwen3_size("tiny", vocab_size=VOCAB), init_std=0.1)
    engine_config = TrainerEngine.Config(
        max_tokens_per_microbatch=max_tokens, shard_threads=shard_threads
    )
    return engine_config.build(model=materialize(config, seed=0), lora=lora)


def _batch(seed: int, count: int = 7) -> list[Datum]:
    generator = torch.Generator().manual_seed(seed)
    data = []
    for index in range(count):
        tokens = torch.randint(0, VOCAB, (4 + (index * 5) % 11,), generator=generator).tolist()
        data.append(_rl_datum(tokens, generator=generator))
    return data


def _rl_datum(tokens: list[int], *, generator: torch.Generator) -> Datum:
    """A PPO datum with random advantages and constant sampler logprobs."""
    return Datum(
        model_input=ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "logprobs": [-1.0] * (len(tokens) - 1),
            "advantages": torch.randn(len(tokens) - 1, generator=generator).tolist(),
        },
    )


def _grads(engine):
    return [None if p.grad is None else p.grad.clone() for p in engine.trainable]


def test_split_is_contiguous_non_empty_and_balanced_by_tokens():
    assert split_by_tokens([128] * 16, 2) == [range(0, 8), range(8, 16)]
    assert split_by_tokens([5, 5, 5, 5, 20], 2) == [range(0, 4), range(4, 5)]
    assert split_by_tokens([7], 4) == [range(0, 1)]
    shards = split_by_tokens([3, 9, 4, 4, 8, 1, 6], 3)
    assert [i for shard in shards for i in shard] == list(range(7))
    assert len(shards) == 3 and all(len(shard) > 0 for shard in shards)


def test_gradients_sum_in_order_and_skip_missing_ones():
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([10.0, 20.0])
    total = sum_gradients([[a, None, None], [b, None, a]])
    assert torch.equal(total[0], a + b) and total[1] is None and torch.equal(total[2], a)


def test_workers_run_single_threaded_and_leave_the_caller_its_threads():
    before = torch.get_num_threads()
    shards = ThreadShards(2)
    try:
        assert shards.map(lambda _: torch.get_num_threads(), range(4)) == [1, 1, 1, 1]
        assert torch.get_num_threads() == before
    finally:
        shards.close()


def test_map_waits_for_every_item_then_raises_the_first_failure():
    shards = ThreadShards(2)
    finished = []

    def work(item: int) -> int:
        if item == 0:
            raise RuntimeError("item 0 failed")
        finished.append(item)
        return item

    try:
        with pytest.raises(RuntimeError, match="item 0 failed"):
            shards.map(work, [0, 1, 2])
        assert sorted(finished) == [1, 2]
        assert shards.map(lambda item: item * 2, [1, 2, 3]) == [2, 4, 6]
    finally:
        shards.close()


@pytest.mark.parametrize("max_tokens", [8192, 20], ids=["one-batch-per-shard", "micro-batched"])
@pytest.mark.parametrize("lora", [None, LoraConfig(rank=4)], ids=["full", "lora"])
def test_threaded_results_match_the_single_thread_engine(max_tokens, lora):
    serial = _engine(shard_threads=1, max_tokens=max_tokens, lora=lora)
    threaded = _engine(shard_threads=2, max_tokens=max_tokens, lora=lora)
    for seed in (1, 2):  # two calls: gradients accumulate
        expected = serial.forward_backward(_batch(seed), "importance_sampling")
        got = threaded.forward_backward(_batch(seed), "importance_sampling")
        assert got.metrics["loss:sum"] == pytest.approx(expected.metrics["loss:sum"], rel=1e-5)
        for ours, theirs in zip(got.loss_fn_outputs, expected.loss_fn_outputs, strict=True):
            for key in ("logprobs", "elementwise_loss"):
                torch.testing.assert_close(
                    ours[key].to_torch(), theirs[key].to_torch(), rtol=0, atol=1e-5
                )
    for ours, theirs in zip(_grads(threaded), _grads(serial), strict=True):
        scale = theirs.abs().max().item()
        assert (ours - theirs).abs().max().item() <= 1e-5 * scale
    forward = threaded.forward(_batch(3), "importance_sampling")
    expected = serial.forward(_batch(3), "importance_sampling")
    assert forward.metrics["loss:sum"] == pytest.approx(expected.metrics["loss:sum"], rel=1e-5)


def test_threaded_training_is_bitwise_the_same_on_every_run():
    def train() -> list[torch.Tensor]:
        engine = _engine(shard_threads=2, max_tokens=30)
        for seed in range(3):
            engine.forward_backward(_batch(seed), "importance_sampling")
            engine.optim_step(AdamParams(learning_rate=1e-2))
        return [p.detach().clone() for p in engine.trainable]

    first, second = train(), train()
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def test_a_failing_shard_leaves_the_accumulated_gradients_untouched(monkeypatch):
    engine = _engine(shard_threads=2)
    engine.forward_backward(_batch(1), "importance_sampling")
    grads = _grads(engine)
    original = engine._logprobs_N

    def failing_second_shard(batch):
        if batch.datums[0].index > 0:
            raise RuntimeError("simulated failure in a shard")
        return original(batch)

    monkeypatch.setattr(engine, "_logprobs_N", failing_second_shard)
    with pytest.raises(RuntimeError, match="simulated failure"):
        engine.forward_backward(_batch(2), "importance_sampling")
    for before, parameter in zip(grads, engine.trainable, strict=True):
        assert torch.equal(parameter.grad, before)


def test_shard_threads_must_be_positive():
    with pytest.raises(ValueError, match="shard_threads must be >= 1, got 0"):
        TrainerEngine.Config(shard_threads=0)


def test_threaded_shared_prefix_groups_match_the_single_thread_engine():
    # GRPO-like: 4 prompts x 3 completions, so shared-prefix packing engages in each shard.
    generator = torch.Generator().manual_seed(7)
    data = []
    for _ in range(4):
        prompt = torch.randint(0, VOCAB, (9,), generator=generator).tolist()
        for _ in range(3):
            tokens = prompt + torch.randint(0, VOCAB, (4,), generator=generator).tolist()
            data.append(_rl_datum(tokens, generator=generator))
    serial, threaded = _engine(shard_threads=1), _engine(shard_threads=2)
    expected = serial.forward_backward(data, "ppo")
    got = threaded.forward_backward(data, "ppo")
    assert got.metrics["loss:sum"] == pytest.approx(expected.metrics["loss:sum"], rel=1e-5)
    for ours, theirs in zip(got.loss_fn_outputs, expected.loss_fn_outputs, strict=True):
        torch.testing.assert_close(
            ours["logprobs"].to_torch(), theirs["logprobs"].to_torch(), rtol=0, atol=2e-5
        )
    for ours, theirs in zip(_grads(threaded), _grads(serial), strict=True):
        assert (ours - theirs).abs().max().item() <= 1e-4 * theirs.abs().max().item()
