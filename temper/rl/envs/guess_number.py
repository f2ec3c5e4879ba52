"""The guessing game: find a secret number; the env answers higher ("+") or lower ("-").

    1-100:50<eos>+75<eos>-62<eos>+68<eos>

The initial observation names the range; each action is a guess (digits, then EOS); each
observation is one character, "+" (the secret is higher) or "-" (lower). A right guess ends the
episode with reward `1 - turn_penalty * (turns - 1)` (at least 0), so fewer turns pay more; a
guess that is not a number ends it with reward 0 ("invalid"). The turn limit is the episode
runner's `max_turns`. Demonstrations play binary search. Held-out secrets are a fixed hash
split of the range, so evaluation plays numbers the policy never searched for in training.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from temper.config.configurable import Configurable
from temper.rl.env import Demonstration, StepResult
from temper.tasks.problem import check_heldout_percent, split_of
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
        """Share of the secrets (by hash) kept for held-out evaluation, in percent."""
        turn_penalty: float = 0.1
        """Reward lost per guess before the right one."""

        def __post_init__(self) -> None:
            if not 0 <= self.low < self.high:
                raise ValueError(
                    f"GuessNumber.Config needs 0 <= low < high, got low={self.low}, "
                    f"high={self.high}"
                )
            check_heldout_percent("GuessNumber.Config", self.heldout_percent)
            if self.turn_penalty < 0:
                raise ValueError(
                    f"GuessNumber.Config.turn_penalty must be >= 0, got {self.turn_penalty}"
                )

    def __init__(self, config: Config, *, tokenizer: Tokenizer) -> None:
        self.config, self.tokenizer = config, tokenizer
        numbers = range(config.low, config.high + 1)
        self.secrets = {
            split: [n for n in numbers if split_of(str(n), heldout_percent=config.heldout_percent)
                    == split]
            for split in ("train", "heldout")
        }  # fmt: skip
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
        """Binary search for a training secret."""
        secret = rng.choice(self.secrets["train"])
        tokens = self.prompt_tokens()
        weights = [0.0] * len(tokens)
        low, high = self.config.low, self.config.high
        while True:
            guess = (low + high) // 2
            action = [*self.tokenizer.encode(str(guess)), self.tokenizer.eos_token_id]
            tokens += action
            weights += [1.0] * len(action)
            if guess == secret:
                return Demonstration(tokens=tokens, weights=weights)
            low, high = (guess + 1, high) if secret > guess else (low, guess - 1)
            hint = self.tokenizer.encode("+" if secret > guess else "-")
            tokens += hint
            weights += [0.0] * len(hint)
