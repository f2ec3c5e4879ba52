"""Group advantages against hand-computed values."""

from __future__ import annotations

import pytest

from temper.rl.advantages import group_advantages, is_uniform


def test_grpo_normalizes_by_the_group_std():
    # rewards 1, 0, 0, 1: mean 0.5, population std 0.5
    assert group_advantages([1, 0, 0, 1], mode="grpo") == pytest.approx([1, -1, -1, 1], abs=1e-5)


def test_dr_grpo_only_subtracts_the_mean():
    assert group_advantages([1, 0, 0, 0], mode="dr_grpo") == pytest.approx(
        [0.75, -0.25, -0.25, -0.25]
    )


def test_rloo_uses_the_mean_of_the_others():
    # member 0: 1 - (0 + 0 + 1) / 3; member 1: 0 - (1 + 0 + 1) / 3
    assert group_advantages([1, 0, 0, 1], mode="rloo") == pytest.approx(
        [2 / 3, -2 / 3, -2 / 3, 2 / 3]
    )


def test_uniform_groups_and_bad_input():
    assert is_uniform([1, 1, 1]) and not is_uniform([1, 0])
    assert group_advantages([1, 1], mode="grpo") == [0.0, 0.0]
    with pytest.raises(ValueError, match="at least 2 members"):
        group_advantages([1], mode="grpo")
    with pytest.raises(ValueError, match="advantage mode must be"):
        group_advantages([1, 0], mode="ppo")
