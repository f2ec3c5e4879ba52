"""The multi-turn recipes: listed, built, round-tripped through config.json, and their envs
told apart by field names; an env source's demonstrations are episodes it rewards."""

from __future__ import annotations

import dataclasses
import random
import typing

import pytest

from temper.config import get_recipe, list_recipes
from temper.config.serialize import load_config, save_config
from temper.rl.envs import EnvConfig
from temper.rl.job import RLJob
from temper.tokenizer import build_builtin_tokenizer

MULTITURN_RECIPES = ("guess_number", "tool_arithmetic")


def test_multiturn_recipes_are_listed():
    assert set(MULTITURN_RECIPES) <= {info.name for info in list_recipes()}


@pytest.mark.parametrize("name", MULTITURN_RECIPES)
def test_recipe_round_trips_and_its_demonstrations_succeed(name, tmp_path):
    config = get_recipe(name).fn()
    assert isinstance(config.build(), RLJob) and config.env is not None
    save_config(tmp_path / "config.json", config, recipe=name)
    assert load_config(tmp_path / "config.json").config == config
    tokenizer = build_builtin_tokenizer("digits")
    source = config.env.build(tokenizer=tokenizer)
    assert source.heldout_envs(4)
    # A demonstration fits the context and trains on the policy's tokens, not the prompt.
    demo = source.demonstration(random.Random(0))
    assert len(demo.tokens) <= config.episodes.max_context
    assert any(demo.weights) and not any(demo.weights[:3])


def test_env_configs_have_distinct_field_sets():
    members = typing.get_args(EnvConfig)
    field_sets = {frozenset(f.name for f in dataclasses.fields(member)) for member in members}
    assert len(field_sets) == len(members)
