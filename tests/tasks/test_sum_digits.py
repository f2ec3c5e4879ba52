"""sum_digits problems: correct answers, disjoint splits, exact-match reward."""

from __future__ import annotations

import random

import pytest

from temper.tasks import SumDigits


def test_answers_are_digit_sums_and_splits_are_disjoint():
    task = SumDigits.Config(min_digits=2, max_digits=4).build()
    rng = random.Random(0)
    train = [task.sample(rng, split="train") for _ in range(500)]
    heldout = [task.sample(rng, split="heldout") for _ in range(200)]
    for problem in train + heldout:
        number = problem.prompt.removesuffix("=")
        assert 2 <= len(number) <= 4 and number[0] != "0"
        assert problem.answer == str(sum(int(d) for d in number))
    assert not {p.prompt for p in train} & {p.prompt for p in heldout}


def test_split_share_is_close_to_configured():
    task = SumDigits.Config(heldout_percent=10).build()
    share = sum(task.split_of(n) == "heldout" for n in range(10_000)) / 10_000
    assert 0.08 < share < 0.12


def test_reward_is_exact_match():
    task = SumDigits.Config().build()
    problem = task.sample(random.Random(1), split="train")
    assert task.reward(problem, problem.answer) == 1.0
    assert task.reward(problem, f" {problem.answer}\n") == 1.0
    assert task.reward(problem, problem.answer + "0") == 0.0


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"min_digits": 5, "max_digits": 3}, "min_digits <= max_digits"),
        ({"heldout_percent": 0}, "heldout_percent"),
    ],
)
def test_bad_config(overrides, message):
    with pytest.raises(ValueError, match=message):
        SumDigits.Config(**overrides)
