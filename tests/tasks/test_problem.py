"""What every task shares: rewards are checked where the jobs score them."""

from __future__ import annotations

import math
import random

import pytest

from temper.tasks import SumDigits
from temper.tasks.problem import scored


class OddReward(SumDigits):
    def __init__(self, value: object) -> None:
        super().__init__(SumDigits.Config())
        self.value = value

    def reward(self, problem, completion):
        return self.value


@pytest.mark.parametrize("value", ["yes", math.nan, math.inf, None, [1.0]])
def test_a_reward_that_is_not_a_finite_number_names_the_task_and_problem(value):
    task = OddReward(value)
    problem = task.sample(random.Random(0), split="train")
    with pytest.raises(
        ValueError, match=rf"OddReward.reward returned .* for problem '{problem.prompt}'"
    ):
        scored(task, problem, "7")


def test_a_reward_is_a_float():
    task = SumDigits.Config().build()
    problem = task.sample(random.Random(0), split="train")
    assert scored(task, problem, problem.answer) == 1.0
    assert scored(OddReward(True), problem, "") == 1.0  # a bool or int counts as its number
