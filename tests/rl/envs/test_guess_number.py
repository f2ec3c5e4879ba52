"""The guessing game's env source: held-out secrets on binary search's paths, demonstrations
that mix binary and quarter-point search, and bad settings refused when the config is made."""

from __future__ import annotations

import random

import pytest

from temper.rl.envs import GuessNumber
from temper.tokenizer import build_builtin_tokenizer


def _guesses(source: GuessNumber, demo_tokens: list[int]) -> list[int]:
    text = source.tokenizer.decode(demo_tokens[len(source.prompt_tokens()) :])
    eos = source.tokenizer.decode([source.tokenizer.eos_token_id])
    return [int(part.strip("+-")) for part in text.split(eos) if part.strip("+-")]


def test_heldout_secrets_on_search_paths_are_guessed_by_some_training_search():
    tokenizer = build_builtin_tokenizer("digits")
    config = GuessNumber.Config(low=1, high=127, heldout_percent=30)
    every = GuessNumber(config, tokenizer=tokenizer)
    on_paths = GuessNumber(
        GuessNumber.Config(low=1, high=127, heldout_percent=30, heldout_secrets="on_search_paths"),
        tokenizer=tokenizer,
    )
    assert on_paths.secrets["train"] == every.secrets["train"]
    assert 0 < len(on_paths.secrets["heldout"]) < len(every.secrets["heldout"])
    # Binary search in 1..127 guesses the odd numbers last (the tree's leaves): a held-out
    # leaf is never guessed on the way to a training secret.
    assert all(n % 2 == 0 for n in on_paths.secrets["heldout"])
    assert set(on_paths.secrets["heldout"]) <= set(every.secrets["heldout"])


def test_demonstrations_mix_binary_and_quarter_point_search():
    tokenizer = build_builtin_tokenizer("digits")
    source = GuessNumber(
        GuessNumber.Config(low=1, high=127, binary_demonstrations=0.3), tokenizer=tokenizer
    )
    rng = random.Random(0)
    first_guesses = [_guesses(source, source.demonstration(rng).tokens)[0] for _ in range(200)]
    assert set(first_guesses) == {64, 32}  # the middle of 1..127, and its first quarter
    assert 0.2 < first_guesses.count(64) / 200 < 0.4


@pytest.mark.parametrize(
    "fields, named",
    [
        ({"binary_demonstrations": 1.5}, "binary_demonstrations"),
        ({"heldout_secrets": "leaves"}, "heldout_secrets"),
    ],
)
def test_bad_settings_are_refused(fields, named):
    with pytest.raises(ValueError, match=named):
        GuessNumber.Config(**fields)
