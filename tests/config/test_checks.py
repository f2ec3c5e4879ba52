"""The config checks: what they accept, and messages that name the field, the value and what
is valid."""

from __future__ import annotations

import math

import numpy as np
import pytest

from temper.config.checks import WrongTypeError, check_choice, check_range, check_span


@pytest.mark.parametrize(
    ("value", "bounds", "message"),
    [
        (0, {"greater_than": 0}, "F.x must be > 0, got 0"),
        (0, {"at_least": 1}, "F.x must be >= 1, got 0"),
        (2, {"at_most": 1}, "F.x must be <= 1, got 2"),
        (1, {"less_than": 1}, "F.x must be < 1, got 1"),
        (1.0, {"at_least": 0, "less_than": 1}, "F.x must be in [0, 1), got 1.0"),
        (0.0, {"greater_than": 0, "at_most": 1}, "F.x must be in (0, 1], got 0.0"),
        (1.5, {"greater_than": 0, "less_than": 1}, "F.x must be in (0, 1), got 1.5"),
        (-1, {"at_least": 0, "at_most": 1}, "F.x must be in [0, 1], got -1"),
        (math.nan, {"at_least": 0}, "F.x must be >= 0, got nan"),
        (math.inf, {"at_least": 0}, "F.x must be >= 0, got inf"),
        (np.float64(-0.5), {"at_least": 0}, "F.x must be >= 0, got -0.5"),
        (-1.0, {"at_least": 0, "finite": True}, "F.x must be a finite number >= 0, got -1.0"),
        (0, {"integer": True, "at_least": 1}, "F.x must be an int >= 1, got 0"),
        (0, {"integer": True, "greater_than": 0}, "F.x must be a positive int, got 0"),
        (
            100,
            {"integer": True, "at_least": 1, "at_most": 99},
            "F.x must be an int in 1..99, got 100",
        ),
    ],
)
def test_a_value_out_of_range_is_named_with_the_range(value, bounds, message):
    with pytest.raises(ValueError) as raised:
        check_range(value, field="F.x", **bounds)
    assert type(raised.value) is ValueError
    assert str(raised.value) == message


@pytest.mark.parametrize(
    ("value", "bounds"),
    [
        (0.5, {"greater_than": 0}),
        (1, {"at_least": 1}),
        (0, {"at_least": 0, "less_than": 1}),
        (1, {"greater_than": 0, "at_most": 1}),
        (np.int64(3), {"at_least": 1}),
        (7, {"integer": True, "at_least": 1, "at_most": 7}),
        (-5, {}),
    ],
)
def test_a_value_in_range_passes(value, bounds):
    check_range(value, field="F.x", **bounds)


def test_the_hint_follows_what_is_valid():
    with pytest.raises(ValueError, match=r"^F\.x must be >= 0 \(0 turns it off\), got -1$"):
        check_range(-1, field="F.x", at_least=0, hint="0 turns it off")


def test_also_names_the_values_valid_besides_the_range():
    also = ("auto", None)
    for value in ("auto", None, 3):
        check_range(value, field="F.x", integer=True, at_least=1, also=also)
    with pytest.raises(ValueError) as raised:
        check_range(0, field="F.x", integer=True, at_least=1, also=also)
    assert str(raised.value) == "F.x must be 'auto', an int >= 1 or None, got 0"
    with pytest.raises(ValueError, match=r"^F\.x must be >= 2 or None, got 1$"):
        check_range(1, field="F.x", at_least=2, also=(None,))
    with pytest.raises(ValueError, match=r"^F\.x must be -1 or an int >= 1 \(-1: all\), got 0$"):
        check_range(0, field="F.x", integer=True, at_least=1, also=(-1,), hint="-1: all")


@pytest.mark.parametrize(
    ("value", "kwargs", "message"),
    [
        ("1e-3", {"at_least": 0}, "F.x must be a number, got '1e-3'"),
        (True, {"at_least": 0}, "F.x must be a number, got True"),
        (None, {"greater_than": 0}, "F.x must be a number, got None"),
        ([1], {"at_least": 0, "also": (None,)}, "F.x must be a number or None, got [1]"),
        (2.0, {"integer": True, "at_least": 1}, "F.x must be an int >= 1, got 2.0"),
        (True, {"integer": True, "at_least": 1}, "F.x must be an int >= 1, got True"),
        ("two", {"integer": True, "also": ("auto",)}, "F.x must be 'auto' or an int, got 'two'"),
        (1.5, {"integer": True, "also": (None,)}, "F.x must be an int or None, got 1.5"),
    ],
)
def test_a_value_of_the_wrong_type_is_a_type_error_and_a_value_error(value, kwargs, message):
    with pytest.raises(WrongTypeError) as raised:
        check_range(value, field="F.x", **kwargs)
    assert isinstance(raised.value, TypeError) and isinstance(raised.value, ValueError)
    assert str(raised.value) == message


def test_true_is_not_one_and_one_is_not_true():
    with pytest.raises(WrongTypeError):
        check_range(True, field="F.x", integer=True, also=(1,))
    with pytest.raises(ValueError, match=r"^F\.x must be True or False, got 1$"):
        check_choice(1, field="F.x", choices=(True, False))
    check_choice(False, field="F.x", choices=(True, False))


def test_check_choice_lists_the_choices():
    check_choice("sync", field="F.mode", choices=("sync", "async"))
    with pytest.raises(ValueError) as raised:
        check_choice("eager", field="F.mode", choices=("sync", "async"))
    assert str(raised.value) == "F.mode must be 'sync' or 'async', got 'eager'"
    with pytest.raises(ValueError) as raised:
        check_choice(None, field="F.p", choices=("auto", "on", "off"), hint="see --help")
    assert str(raised.value) == "F.p must be 'auto', 'on' or 'off' (see --help), got None"


def test_check_span_names_both_fields():
    check_span("T.Config", low=("min_digits", 2), high=("max_digits", 2), at_least=1)
    with pytest.raises(ValueError) as raised:
        check_span("T.Config", low=("min_digits", 3), high=("max_digits", 2), at_least=1)
    message = "T.Config needs 1 <= min_digits <= max_digits, got min_digits=3, max_digits=2"
    assert str(raised.value) == message
    with pytest.raises(ValueError, match=r"needs 1 <= min_digits <= max_digits, got min_digits=0"):
        check_span("T.Config", low=("min_digits", 0), high=("max_digits", 2), at_least=1)
    with pytest.raises(ValueError, match=r"^G needs 0 <= low < high, got low=5, high=5$"):
        check_span("G", low=("low", 5), high=("high", 5), at_least=0, strict=True)
