"""reverse_text problems: reversed answers from the alphabet, disjoint splits, exact reward."""

from __future__ import annotations

import random

import pytest

from temper.tasks import ReverseText
from temper.tasks.problem import split_of
from temper.tokenizer import build_builtin_tokenizer


def test_answers_are_reversed_strings_and_splits_are_disjoint():
    task = ReverseText.Config(alphabet="abc", min_length=4, max_length=7).build()
    rng = random.Random(0)
    train = [task.sample(rng, split="train") for _ in range(300)]
    heldout = [task.sample(rng, split="heldout") for _ in range(50)]
    for problem in train + heldout:
        text = problem.prompt.removesuffix("=")
        assert 4 <= len(text) <= 7 and set(text) <= set("abc")
        assert problem.answer == text[::-1]
    assert not {p.prompt for p in train} & {p.prompt for p in heldout}


def test_letters_vocabulary_encodes_one_token_per_character():
    task = ReverseText.Config(alphabet="xyzXYZ019").build()
    tokenizer = build_builtin_tokenizer("letters")
    problem = task.sample(random.Random(3), split="train")
    assert len(tokenizer.encode(problem.prompt)) == len(problem.prompt)
    assert tokenizer.decode(tokenizer.encode(problem.answer)) == problem.answer


def test_reward_is_exact_match():
    task = ReverseText.Config().build()
    problem = task.sample(random.Random(1), split="train")
    assert task.reward(problem, problem.answer + "\n") == 1.0
    assert task.reward(problem, problem.answer[::-1] + "q") == 0.0


def test_a_split_with_no_problems_is_an_error_not_a_hang():
    # One possible string ("a"): it falls in one split, so the other split is empty.
    task = ReverseText.Config(alphabet="a", min_length=1, max_length=1).build()
    empty = "train" if split_of("a=", heldout_percent=10) == "heldout" else "heldout"
    with pytest.raises(ValueError, match=f"no '{empty}' problem in .* draws"):
        task.sample(random.Random(0), split=empty)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"alphabet": ""}, "alphabet"),
        ({"alphabet": "aab"}, "distinct"),
        ({"alphabet": "ab c"}, "whitespace"),
        ({"alphabet": "ab="}, "'='"),
        ({"min_length": 0}, "1 <= min_length"),
        ({"heldout_percent": 0}, "heldout_percent"),
    ],
)
def test_bad_config(overrides, message):
    with pytest.raises(ValueError, match=message):
        ReverseText.Config(**overrides)
