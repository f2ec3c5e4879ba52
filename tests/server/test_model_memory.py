"""ModelMemory on a fake clock: pinned training models, releasable samplers, the 503; the
largest LoRA rank a budget holds (a larger one is the request's 400)."""

from __future__ import annotations

import pytest

from temper.server.http.errors import BadRequest
from temper.server.routes.validation import check_lora_rank_fits
from temper.server.state.base_models import BaseModel, ModelLimits
from temper.server.state.model_memory import MIB, ModelMemory, OverBudget


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def memory(clock: Clock, *, budget_mib: int = 100) -> ModelMemory:
    return ModelMemory(budget_bytes=budget_mib * MIB, idle_seconds=10, clock=clock)


def test_least_recently_used_sampler_makes_room_and_pinned_models_never_do():
    clock = Clock()
    ledger = memory(clock)
    assert ledger.admit("a", base_model="A", what="sampler", num_bytes=40 * MIB, pinned=False) == []
    clock.now = 1
    ledger.admit("b", base_model="B", what="sampler", num_bytes=40 * MIB, pinned=False)
    clock.now = 2
    ledger.use("a")  # b is now the least recently used
    released = ledger.admit("t", base_model="A", what="training", num_bytes=50 * MIB, pinned=True)
    assert released == ["b"]
    assert ledger.loaded() == {"A": 90 * MIB}
    with pytest.raises(OverBudget, match=r"--model-memory-mb 100\).*training on A \(50.0 MiB\)"):
        ledger.admit("c", base_model="C", what="sampler", num_bytes=60 * MIB, pinned=False)
    ledger.release("t")
    assert ledger.admit("c", base_model="C", what="sampler", num_bytes=60 * MIB, pinned=False) == []


def test_what_cannot_fit_once_samplers_are_released_releases_none_of_them():
    clock = Clock()
    ledger = memory(clock)
    ledger.admit("s", base_model="A", what="sampler", num_bytes=30 * MIB, pinned=False)
    ledger.admit("t", base_model="A", what="training", num_bytes=50 * MIB, pinned=True)
    with pytest.raises(OverBudget, match=r"held by sampler on A \(30.0 MiB\); training on A"):
        ledger.admit("u", base_model="A", what="training", num_bytes=60 * MIB, pinned=True)
    with pytest.raises(
        OverBudget,
        match=r"needs 120.0 MiB, more than the whole model memory "
        r"budget \(--model-memory-mb 100\); raise --model-memory-mb$",
    ):
        ledger.admit("u", base_model="A", what="training", num_bytes=120 * MIB, pinned=True)
    assert ledger.loaded() == {"A": 80 * MIB}  # the sampler still loaded


def test_idle_samplers_are_released_and_training_models_are_not():
    clock = Clock()
    ledger = memory(clock)
    ledger.admit("s", base_model="B", what="sampler", num_bytes=10 * MIB, pinned=False)
    ledger.admit("t", base_model="A", what="training", num_bytes=10 * MIB, pinned=True)
    clock.now = 9
    assert ledger.release_idle() == []
    clock.now = 10.5
    assert ledger.release_idle() == ["s"]
    assert ledger.loaded() == {"A": 10 * MIB}


@pytest.mark.parametrize(
    ("shared_base", "shared_sampler"), [(True, True), (True, False), (False, False)]
)
def test_the_largest_lora_rank_is_the_last_the_budget_holds(shared_base, shared_sampler):
    base = BaseModel(
        name="/m/a",
        names=frozenset({"a"}),
        arch="qwen3",
        limits=ModelLimits(vocab_size=16, max_seq_len=64, max_sample_len=64),
        trainable=True,
        sampleable=True,
        weights_bytes=30 * MIB,
        sampler_bytes=50 * MIB,
        merged_sampler_bytes=50 * MIB,
        lora_bytes_per_rank=3000,
    )
    sharing = {"shared_base": shared_base, "shared_sampler": shared_sampler}
    budget = 100 * MIB
    largest = base.largest_lora_rank(budget_bytes=budget, **sharing)
    assert base.lora_model_bytes(lora_rank=largest, **sharing) <= budget
    assert base.lora_model_bytes(lora_rank=largest + 1, **sharing) > budget
    fits = {"budget_bytes": budget, "field": "create_model: lora_config.rank", **sharing}
    check_lora_rank_fits(base, largest, **fits)
    with pytest.raises(BadRequest, match=f"rank {largest + 1} does not fit.*fits is {largest}$"):
        check_lora_rank_fits(base, largest + 1, **fits)
    # A base the budget cannot hold at any rank is the server's setting: left to the 503.
    assert base.largest_lora_rank(budget_bytes=MIB, **sharing) == 0
    check_lora_rank_fits(base, 10**9, **{**fits, "budget_bytes": MIB})
