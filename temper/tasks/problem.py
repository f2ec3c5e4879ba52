"""What every task shares: the `Problem` type and the seed-independent train/held-out split.

A problem's split is a fixed hash of its key (the prompt text, or a dataset row's question), so
held-out accuracy is measured on problems the model never trains on, whatever the run's seed.
Generated tasks draw until they hit the wanted split; `draw_from_split` bounds the draws, so a
problem space too small to hold both splits is an error instead of an endless loop.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

Split = Literal["train", "heldout"]

MAX_DRAWS = 10_000
"""Draws `draw_from_split` makes before it decides the split is (nearly) empty."""


@dataclass(frozen=True)
class Problem:
    prompt: str
    """Text the policy continues."""
    answer: str
    """The reference completion: the supervised target, and what the reward compares with."""


def split_of(key: str, *, heldout_percent: int) -> Split:
    """'heldout' for about `heldout_percent`% of keys, chosen by a hash (not by any seed)."""
    digest = hashlib.sha256(key.encode()).digest()
    heldout = int.from_bytes(digest[:4], "little") % 100 < heldout_percent
    return "heldout" if heldout else "train"


def draw_from_split(
    draw: Callable[[random.Random], Problem],
    rng: random.Random,
    *,
    split: Split,
    heldout_percent: int,
    owner: str,
    key: Callable[[Problem], str] = lambda problem: problem.prompt,
) -> Problem:
    """Draw problems until one falls in `split`; `key(problem)` is what is hashed."""
    for _ in range(MAX_DRAWS):
        problem = draw(rng)
        if split_of(key(problem), heldout_percent=heldout_percent) == split:
            return problem
    raise ValueError(
        f"{owner}: no {split!r} problem in {MAX_DRAWS} draws; the problem space is too small "
        f"for a {heldout_percent}% held-out split (allow more digits, characters or operations)"
    )


class Task(Protocol):
    """A problem source with a reward: what RL environments and SFT sources are built on."""

    def sample(self, rng: random.Random, *, split: Split) -> Problem: ...

    def reward(self, problem: Problem, completion: str) -> float: ...


def finite_float(value: object) -> float | None:
    """`value` as a float if it is a finite number (a bool, a numpy or 0-d tensor scalar too,
    as float() takes them; not a string), else None."""
    if isinstance(value, str | bytes):
        return None
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def scored(task: Task, problem: Problem, completion: str) -> float:
    """`task.reward(problem, completion)` as a float, checked: a reward that is not a finite
    number is a ValueError naming the task and the problem, not a failure further on (a sum of
    strings, a NaN advantage)."""
    reward = task.reward(problem, completion)
    value = finite_float(reward)
    if value is None:
        raise ValueError(
            f"{type(task).__qualname__}.reward returned {reward!r} for problem "
            f"{problem.prompt!r} and completion {completion!r}; a reward must be a finite number"
        )
    return value


class GeneratedTask:
    """What tasks that generate their problems share: `sample` draws with the task's `_draw`
    until a problem's split key (its prompt, unless `_split_key` says otherwise) falls in the
    wanted split, and `reward` is exact match."""

    config: Any

    def _draw(self, rng: random.Random) -> Problem:
        raise NotImplementedError

    def _split_key(self, problem: Problem) -> str:
        return problem.prompt

    def sample(self, rng: random.Random, *, split: Split) -> Problem:
        """One random problem from `split`."""
        return draw_from_split(
            self._draw,
            rng,
            split=split,
            heldout_percent=self.config.heldout_percent,
            owner=type(self).__name__,
            key=self._split_key,
        )

    def reward(self, problem: Problem, completion: str) -> float:
        """1.0 for exactly the answer (surrounding whitespace ignored), else 0.0."""
        return 1.0 if completion.strip() == problem.answer else 0.0
