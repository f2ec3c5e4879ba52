"""The guessing game: find a secret number; the env answers higher ("+") or lower ("-").

    1-100:50<eos>+75<eos>-62<eos>+68<eos>

The initial observation names the range; each action is a guess (digits, then EOS); each
observation is one character, "+" (the secret is higher) or "-" (lower). A right guess ends the
episode with reward `1 - turn_penalty * (turns - 1)` (at least 0), so fewer turns pay more; a
guess that is not a number ends it with reward 0 ("invalid"). The turn limit is the episode
runner's `max_turns`. Demonstrations play binary search, or for a configured share of them a
slower quarter-point search (RL then has a better strategy to find). Held-out secrets are a
fixed hash split of the range, so evaluation plays numbers the policy never searched for in
training; optionally only those that binary search guesses on its way to some training secret
(a model trained from scratch does not name a number no training episode names).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from temper.config.checks import check_choice, check_range, check_span
from temper.config.configurable import Configurable
from temper.rl.env import Demonstration, StepResult, Turns
from temper.tasks.problem import split_of
from temper.tokenizer import Tokenizer


class GuessNumberEnv:
    """One game against one secret number."""

    def __init__(self, secret: int, *, source: GuessNumber) -> None:
        self.secret, self.source = secret, source
        self.num_guesses = 0

    def initial_observation(self) -> list[int]:
        return self.source.prompt_tokens()

    def stop_token_ids(self) -> list[int]:
        return [self.source.tokenizer.eos_token_id]

    def step(self, action_tokens: Sequence[int]) -> StepResult:
        self.num_guesses += 1
        text = self.source.tokenizer.decode(list(action_tokens), skip_special_tokens=True)
        if not text.strip().isdigit():
            return StepResult(reward=0.0, done=True, metrics={"correct": 0.0}, end_reason="invalid")
        guess = int(text)
        if guess == self.secret:
            penalty = self.source.config.turn_penalty * (self.num_guesses - 1)
            return StepResult(reward=max(0.0, 1.0 - penalty), done=True, metrics={"correct": 1.0})
        hint = "+" if self.secret > guess else "-"
        return StepResult(
            reward=0.0, done=False, next_observation=self.source.tokenizer.encode(hint)
        )


class GuessNumber(Configurable):
    @dataclass(kw_only=True)
    class Config(Configurable.Config):
        low: int = 1
        """Smallest secret."""
        high: int = 100
        """Largest secret."""
        heldout_percent: int = 20
        """Share of the secrets (by hash) kept out of training, in percent."""
        heldout_secrets: Literal["all", "on_search_paths"] = "all"
        """Which of the kept-out secrets held-out evaluation plays: all, or only those that
        binary search for some training secret guesses on its way (the others are leaves of
        the search tree: no training episode ever names them, and a model trained from scratch
        does not name a number it was never shown, so no policy finds them)."""
        turn_penalty: float = 0.1
        """Reward lost per guess before the right one."""
        binary_demonstrations: float = 1.0
        """Share of warm-up demonstrations that play binary search (guess the middle of the
        numbers still possible); the others guess at the first quarter of them, a valid but
        slower search (up to 14 guesses in 1..100 against 7), which RL must then unlearn."""

        def __post_init__(self) -> None:
            owner = "GuessNumber.Config"
            check_span(
                owner, low=("low", self.low), high=("high", self.high), at_least=0, strict=True
            )
            check_range(
                self.heldout_percent,
                field=f"{owner}.heldout_percent",
                integer=True,
                at_least=1,
                at_most=99,
            )
            check_range(
                self.binary_demonstrations,
                field=f"{owner}.binary_demonstrations",
                at_least=0,
                at_most=1,
            )
            check_choice(
                self.heldout_secrets,
                field=f"{owner}.heldout_secrets",
                choices=("all", "on_search_paths"),
            )
            check_range(self.turn_penalty, field=f"{owner}.turn_penalty", at_least=0)

    turns: Turns = "multi"
    """An env source (temper/rl/env.py) of multi-turn episodes."""

    def __init__(self, config: Config, *, tokenizer: Tokenizer) -> None:
        self.config, self.tokenizer = config, tokenizer
        numbers = range(config.low, config.high + 1)
        self.secrets = {
            split: [n for n in numbers if split_of(str(n), heldout_percent=config.heldout_percent)
                    == split]
            for split in ("train", "heldout")
        }  # fmt: skip
        if config.heldout_secrets == "on_search_paths":
            on_paths = _search_path_numbers(config.low, config.high, self.secrets["train"])
            self.secrets["heldout"] = [n for n in self.secrets["heldout"] if n in on_paths]
        for split, secrets in self.secrets.items():
            if not secrets:
                raise ValueError(f"GuessNumber: no {split!r} secret in {config.low}..{config.high}")

    def prompt_tokens(self) -> list[int]:
        return self.tokenizer.encode(f"{self.config.low}-{self.config.high}:")

    def make_group(
        self, rng: random.Random, *, split: str, group_size: int
    ) -> list[GuessNumberEnv]:
        secret = rng.choice(self.secrets[split])
        return [GuessNumberEnv(secret, source=self) for _ in range(group_size)]

    def heldout_envs(self, count: int) -> list[GuessNumberEnv]:
        """Every held-out secret once (at most `count` of them)."""
        return [GuessNumberEnv(secret, source=self) for secret in self.secrets["heldout"][:count]]

    def demonstration(self, rng: random.Random) -> Demonstration:
        """Binary (or, for a share of them, quarter-point) search for a training secret."""
        secret = rng.choice(self.secrets["train"])
        share = self.config.binary_demonstrations
        binary = share >= 1.0 or rng.random() < share
        tokens = self.prompt_tokens()
        weights = [0.0] * len(tokens)
        low, high = self.config.low, self.config.high
        while True:
            guess = (low + high) // 2 if binary else low + (high - low) // 4
            action = [*self.tokenizer.encode(str(guess)), self.tokenizer.eos_token_id]
            tokens += action
            weights += [1.0] * len(action)
            if guess == secret:
                return Demonstration(tokens=tokens, weights=weights)
            low, high = (guess + 1, high) if secret > guess else (low, guess - 1)
            hint = self.tokenizer.encode("+" if secret > guess else "-")
            tokens += hint
            weights += [0.0] * len(hint)


def _search_path_numbers(low: int, high: int, secrets: Sequence[int]) -> set[int]:
    """Every number binary search over low..high guesses while looking for one of `secrets`."""
    guessed: set[int] = set()
    for secret in secrets:
        lo, hi = low, high
        while True:
            guess = (lo + hi) // 2
            guessed.add(guess)
            if guess == secret:
                break
            lo, hi = (guess + 1, hi) if secret > guess else (lo, guess - 1)
    return guessed
