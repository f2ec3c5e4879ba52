"""arithmetic problems: correct answers, configured operations and digits, disjoint splits."""

from __future__ import annotations

import random

import pytest

from temper.tasks import Arithmetic


def test_answers_are_correct_and_respect_the_config():
    task = Arithmetic.Config(ops=("add", "mul"), min_digits=2, max_digits=3).build()
    rng = random.Random(0)
    for problem in [task.sample(rng, split="train") for _ in range(300)]:
        expression = problem.prompt.removesuffix("=")
        symbol = "+" if "+" in expression else "*"
        a, b = expression.split(symbol)
        assert 2 <= len(a) <= 3 and 2 <= len(b) <= 3 and a[0] != "0" and b[0] != "0"
        expected = int(a) + int(b) if symbol == "+" else int(a) * int(b)
        assert problem.answer == str(expected)


def test_subtraction_can_be_negative_and_splits_are_disjoint():
    task = Arithmetic.Config(ops=("sub",), max_digits=2).build()
    rng = random.Random(1)
    train = [task.sample(rng, split="train") for _ in range(400)]
    heldout = [task.sample(rng, split="heldout") for _ in range(100)]
    assert any(p.answer.startswith("-") for p in train)
    assert not {p.prompt for p in train} & {p.prompt for p in heldout}


def test_reward_is_exact_match():
    task = Arithmetic.Config().build()
    problem = task.sample(random.Random(2), split="train")
    assert task.reward(problem, f" {problem.answer}\n") == 1.0
    assert task.reward(problem, problem.answer + "1") == 0.0
    assert task.reward(problem, "") == 0.0


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"ops": ()}, "ops"),
        ({"ops": ("add", "add")}, "at most once"),
        ({"ops": ("div",)}, "unknown operation 'div'"),
        ({"min_digits": 3, "max_digits": 2}, "min_digits <= max_digits"),
        ({"heldout_percent": 100}, "heldout_percent"),
    ],
)
def test_bad_config(overrides, message):
    with pytest.raises(ValueError, match=message):
        Arithmetic.Config(**overrides)
