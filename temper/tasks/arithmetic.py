"""arithmetic: answer `a op b` for random operands ("47+385=" -> "432", "12-40=" -> "-28").

Operands have `min_digits`..`max_digits` digits each; the operation is drawn uniformly from
`ops`. Everything fits the built-in "digits" vocabulary. A problem's split is a hash of its
prompt, so "3+4=" and "4+3=" may land in different splits: the held-out set tests unseen
operand pairs, not unseen facts.
"""

from __future__ import annotations

import operator
import random
from collections.abc import Callable
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

from temper.config.checks import check_range, check_span
from temper.config.configurable import Configurable
from temper.tasks.problem import GeneratedTask, Problem

Operation = Literal["add", "sub", "mul"]

_OPERATIONS: MappingProxyType[str, tuple[str, Callable[[int, int], int]]] = MappingProxyType(
    {"add": ("+", operator.add), "sub": ("-", operator.sub), "mul": ("*", operator.mul)}
)


class Arithmetic(GeneratedTask, Configurable):
    @dataclass(kw_only=True)
    class Config(Configurable.Config):
        ops: tuple[Operation, ...] = ("add", "sub", "mul")
        """Operations to draw from: add (+), sub (-, answers may be negative), mul (*)."""
        min_digits: int = 1
        """Fewest digits of an operand."""
        max_digits: int = 3
        """Most digits of an operand."""
        heldout_percent: int = 10
        """Share of all problems (by hash of the prompt) reserved for held-out evaluation."""

        def __post_init__(self) -> None:
            if not self.ops or len(set(self.ops)) != len(self.ops):
                raise ValueError(
                    "Arithmetic.Config.ops must name each operation at most once and at least "
                    f"one of {list(_OPERATIONS)}, got {list(self.ops)}"
                )
            unknown = [op for op in self.ops if op not in _OPERATIONS]
            if unknown:
                raise ValueError(
                    f"Arithmetic.Config.ops: unknown operation {unknown[0]!r}; "
                    f"valid: {list(_OPERATIONS)}"
                )
            check_span(
                "Arithmetic.Config",
                low=("min_digits", self.min_digits),
                high=("max_digits", self.max_digits),
                at_least=1,
            )
            check_range(
                self.heldout_percent,
                field="Arithmetic.Config.heldout_percent",
                integer=True,
                at_least=1,
                at_most=99,
            )

    def __init__(self, config: Config) -> None:
        self.config = config

    def _draw(self, rng: random.Random) -> Problem:
        symbol, apply = _OPERATIONS[rng.choice(self.config.ops)]
        a, b = self._operand(rng), self._operand(rng)
        return Problem(prompt=f"{a}{symbol}{b}=", answer=str(apply(a, b)))

    def _operand(self, rng: random.Random) -> int:
        num_digits = rng.randint(self.config.min_digits, self.config.max_digits)
        low = 0 if num_digits == 1 else 10 ** (num_digits - 1)
        return rng.randint(low, 10**num_digits - 1)
