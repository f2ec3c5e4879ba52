from __future__ import annotations

import math

import pytest

from temper.losses import get_loss, resolve_config


def test_defaults_apply_and_given_values_win():
    assert resolve_config(get_loss("ppo"), None) == {
        "clip_low_threshold": 0.8,
        "clip_high_threshold": 1.2,
    }
    resolved = resolve_config(get_loss("ppo"), {"clip_high_threshold": 2})
    assert resolved == {"clip_low_threshold": 0.8, "clip_high_threshold": 2.0}
    assert type(resolved["clip_high_threshold"]) is float
    assert resolve_config(get_loss("cross_entropy"), {}) == {}


def test_unknown_key_names_key_loss_and_valid_keys():
    with pytest.raises(ValueError) as error:
        resolve_config(get_loss("ppo"), {"clip_ratio": 0.2})
    message = str(error.value)
    for part in ("'clip_ratio'", "'ppo'", "clip_low_threshold", "clip_high_threshold"):
        assert part in message
    with pytest.raises(ValueError, match="valid keys: none"):
        resolve_config(get_loss("cross_entropy"), {"beta": 1.0})


def test_missing_required_key():
    with pytest.raises(ValueError, match=r"'dro' needs loss_fn_config key.*beta"):
        resolve_config(get_loss("dro"), {})


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_values_are_rejected(value):
    with pytest.raises(ValueError, match=r"clip_low_threshold.*finite"):
        resolve_config(get_loss("cispo"), {"clip_low_threshold": value})


@pytest.mark.parametrize("value", ["0.5", True, None])
def test_non_numbers_are_rejected(value):
    with pytest.raises(TypeError, match=r"beta.*number"):
        resolve_config(get_loss("dro"), {"beta": value})


def test_caller_mapping_is_not_mutated():
    given = {"beta": 1}
    resolve_config(get_loss("dro"), given)
    assert given == {"beta": 1}
