"""sum_digits: given a number, answer the sum of its digits ("4821=" -> "15").

Problems are drawn at random from the numbers with `min_digits`..`max_digits` digits. A fixed,
seed-independent hash puts every number in exactly one split, so held-out accuracy is measured
on numbers the model never trains on.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from temper.config.checks import check_range, check_span
from temper.config.configurable import Configurable
from temper.tasks.problem import (
    GeneratedTask,
    Problem,
    Split,
    split_of,
)

__all__ = ["Problem", "SumDigits"]


class SumDigits(GeneratedTask, Configurable):
    @dataclass(kw_only=True)
    class Config(Configurable.Config):
        min_digits: int = 2
        """Fewest digits in a problem's number."""
        max_digits: int = 6
        """Most digits in a problem's number."""
        heldout_percent: int = 10
        """Share of all numbers (by hash) reserved for held-out evaluation, in percent."""

        def __post_init__(self) -> None:
            check_span(
                "SumDigits.Config",
                low=("min_digits", self.min_digits),
                high=("max_digits", self.max_digits),
                at_least=1,
            )
            check_range(
                self.heldout_percent,
                field="SumDigits.Config.heldout_percent",
                integer=True,
                at_least=1,
                at_most=99,
            )

    def __init__(self, config: Config) -> None:
        self.config = config

    def split_of(self, number: int) -> Split:
        return split_of(str(number), heldout_percent=self.config.heldout_percent)

    def _split_key(self, problem: Problem) -> str:
        return problem.prompt.removesuffix("=")  # the number itself

    def _draw(self, rng: random.Random) -> Problem:
        num_digits = rng.randint(self.config.min_digits, self.config.max_digits)
        low = 0 if num_digits == 1 else 10 ** (num_digits - 1)
        number = rng.randint(low, 10**num_digits - 1)
        return Problem(prompt=f"{number}=", answer=str(sum(map(int, str(number)))))
