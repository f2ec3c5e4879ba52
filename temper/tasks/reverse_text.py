"""reverse_text: write a short string backwards ("stone=" -> "enots").

Strings are `min_length`..`max_length` characters drawn uniformly from `alphabet` (lower-case
letters by default, which the built-in "letters" vocabulary encodes one token per character:
use base model "tiny:letters"). The held-out split is a hash of the string.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass

from temper.config.checks import check_range, check_span
from temper.config.configurable import Configurable
from temper.tasks.problem import GeneratedTask, Problem

SEPARATOR = "="
"""Ends the string in a prompt; the answer follows it."""


class ReverseText(GeneratedTask, Configurable):
    @dataclass(kw_only=True)
    class Config(Configurable.Config):
        alphabet: str = string.ascii_lowercase
        """Characters strings are made of (distinct, printable, no whitespace and no '=')."""
        min_length: int = 3
        """Shortest string."""
        max_length: int = 6
        """Longest string."""
        heldout_percent: int = 10
        """Share of all strings (by hash) reserved for held-out evaluation, in percent."""

        def __post_init__(self) -> None:
            bad = [c for c in self.alphabet if c.isspace() or c == SEPARATOR or not c.isprintable()]
            if not self.alphabet or bad or len(set(self.alphabet)) != len(self.alphabet):
                raise ValueError(
                    "ReverseText.Config.alphabet must be distinct printable characters without "
                    f"whitespace or {SEPARATOR!r}, got {self.alphabet!r}"
                )
            check_span(
                "ReverseText.Config",
                low=("min_length", self.min_length),
                high=("max_length", self.max_length),
                at_least=1,
            )
            check_range(
                self.heldout_percent,
                field="ReverseText.Config.heldout_percent",
                integer=True,
                at_least=1,
                at_most=99,
            )

    def __init__(self, config: Config) -> None:
        self.config = config

    def _draw(self, rng: random.Random) -> Problem:
        length = rng.randint(self.config.min_length, self.config.max_length)
        text = "".join(rng.choice(self.config.alphabet) for _ in range(length))
        return Problem(prompt=f"{text}{SEPARATOR}", answer=text[::-1])
