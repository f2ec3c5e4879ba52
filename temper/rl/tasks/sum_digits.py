"""sum_digits: given a number, answer the sum of its digits ("4821=" -> "15").

Problems are drawn at random from the numbers with `min_digits`..`max_digits` digits. A fixed,
seed-independent hash puts every number in exactly one split, so held-out accuracy is measured
on numbers the model never trains on.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Literal

from temper.config.configurable import Configurable

Split = Literal["train", "heldout"]


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str


class SumDigits(Configurable):
    @dataclass(kw_only=True)
    class Config(Configurable.Config):
        min_digits: int = 2
        """Fewest digits in a problem's number."""
        max_digits: int = 6
        """Most digits in a problem's number."""
        heldout_percent: int = 10
        """Share of all numbers (by hash) reserved for held-out evaluation, in percent."""

        def __post_init__(self) -> None:
            if not 1 <= self.min_digits <= self.max_digits:
                raise ValueError(
                    "SumDigits.Config needs 1 <= min_digits <= max_digits, got "
                    f"min_digits={self.min_digits}, max_digits={self.max_digits}"
                )
            if not 0 < self.heldout_percent < 100:
                raise ValueError(
                    f"SumDigits.Config.heldout_percent must be in 1..99, got {self.heldout_percent}"
                )

    def __init__(self, config: Config) -> None:
        self.config = config

    def split_of(self, number: int) -> Split:
        digest = hashlib.sha256(str(number).encode()).digest()
        heldout = int.from_bytes(digest[:4], "little") % 100 < self.config.heldout_percent
        return "heldout" if heldout else "train"

    def sample(self, rng: random.Random, *, split: Split) -> Problem:
        """One random problem from `split`."""
        while True:
            num_digits = rng.randint(self.config.min_digits, self.config.max_digits)
            low = 0 if num_digits == 1 else 10 ** (num_digits - 1)
            number = rng.randint(low, 10**num_digits - 1)
            if self.split_of(number) == split:
                return Problem(prompt=f"{number}=", answer=str(sum(map(int, str(number)))))

    def reward(self, problem: Problem, completion: str) -> float:
        """1.0 for exactly the right answer, else 0.0."""
        return 1.0 if completion.strip() == problem.answer else 0.0
