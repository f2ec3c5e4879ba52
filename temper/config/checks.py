"""Range and choice checks for config fields, with one wording for every message.

A message reads `<field> must be <what is valid> (<hint>), got <value>`:

    check_range(self.ttl_s, field="StabilityStore.Config.ttl_s", greater_than=0)
    # StabilityStore.Config.ttl_s must be > 0, got 0
    check_range(self.rank, field="LoraConfig.rank", integer=True, at_least=1)
    # LoraConfig.rank must be an int >= 1, got 2.0
    check_range(self.max_model_len, field="VllmGenerator.Config.max_model_len", at_least=2,
                also=(None,))
    # VllmGenerator.Config.max_model_len must be >= 2 or None, got 1
    check_choice(self.mode, field="RLJob.Config.mode", choices=("sync", "async"))
    # RLJob.Config.mode must be 'sync' or 'async', got 'eager'

NaN and the infinities fail every range: no setting means "unlimited" by infinity, and NaN
compares false with every bound. A value of the wrong type raises `WrongTypeError`.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence


class WrongTypeError(TypeError, ValueError):
    """A value of the wrong type for its field (a str or a bool where a number is meant).

    Also a ValueError, so that whatever reports bad settings (the command line's error line,
    a server's 400 answer) reports this one with the others."""


def check_range(
    value: object,
    *,
    field: str,
    at_least: float | None = None,
    greater_than: float | None = None,
    at_most: float | None = None,
    less_than: float | None = None,
    integer: bool = False,
    finite: bool = False,
    also: Sequence[object] = (),
    hint: str | None = None,
) -> None:
    """Refuse `value` unless it is a number within the bounds given, or one of `also`.

    integer: only an int is valid (a bool or 2.0 is not), and the message says "an int".
    finite: the message says "a finite number" (every range refuses NaN and infinities).
    also: values valid besides the range (None, 'auto'), named in the message.
    hint: said in parentheses after what is valid: what a special value means, a related
    field, a unit.
    """
    assert at_least is None or greater_than is None, "give one lower bound"
    assert at_most is None or less_than is None, "give one upper bound"
    if _is_one_of(value, also):
        return
    bounds = _bounds(at_least, greater_than, at_most, less_than, integer=integer)
    if integer:
        positive = greater_than == 0 and at_most is None and less_than is None
        valid = _either(also, "a positive int" if positive else f"an int {bounds}".strip())
        if isinstance(value, bool) or not isinstance(value, int):
            raise WrongTypeError(_message(field, valid, hint, value))
    else:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise WrongTypeError(_message(field, _either(also, "a number"), None, value))
        noun = "a finite number " if finite else ""
        valid = _either(also, f"{noun}{bounds}".strip() or "a number")
    if not _within(value, at_least, greater_than, at_most, less_than):
        raise ValueError(_message(field, valid, hint, value))


def check_choice(
    value: object, *, field: str, choices: Sequence[object], hint: str | None = None
) -> None:
    """Refuse `value` unless it is one of `choices`."""
    if not _is_one_of(value, choices):
        raise ValueError(_message(field, _either(choices, ""), hint, value))


def check_span(
    owner: str,
    *,
    low: tuple[str, float],
    high: tuple[str, float],
    at_least: float,
    strict: bool = False,
) -> None:
    """Refuse a pair of fields, given as (name, value), unless `at_least <= low <= high`
    (`low < high` when `strict`)."""
    (low_name, low_value), (high_name, high_value) = low, high
    ordered = low_value < high_value if strict else low_value <= high_value
    if not (at_least <= low_value and ordered):
        relation = "<" if strict else "<="
        raise ValueError(
            f"{owner} needs {at_least} <= {low_name} {relation} {high_name}, got "
            f"{low_name}={low_value}, {high_name}={high_value}"
        )


def _bounds(
    at_least: float | None,
    greater_than: float | None,
    at_most: float | None,
    less_than: float | None,
    *,
    integer: bool,
) -> str:
    """The bounds in words: '>= 1', 'in (0, 40]', 'in 1..99' (an int in a closed range)."""
    low = at_least if at_least is not None else greater_than
    high = at_most if at_most is not None else less_than
    if low is not None and high is not None:
        if integer and at_least is not None and at_most is not None:
            return f"in {low}..{high}"
        opening = "[" if at_least is not None else "("
        closing = "]" if at_most is not None else ")"
        return f"in {opening}{low}, {high}{closing}"
    for bound, relation in (
        (at_least, ">="),
        (greater_than, ">"),
        (at_most, "<="),
        (less_than, "<"),
    ):
        if bound is not None:
            return f"{relation} {bound}"
    return ""


def _within(
    value: float,
    at_least: float | None,
    greater_than: float | None,
    at_most: float | None,
    less_than: float | None,
) -> bool:
    if not -float("inf") < value < float("inf"):  # NaN too
        return False
    return (
        (at_least is None or value >= at_least)
        and (greater_than is None or value > greater_than)
        and (at_most is None or value <= at_most)
        and (less_than is None or value < less_than)
    )


def _is_one_of(value: object, options: Sequence[object]) -> bool:
    """`value in options`, except that True is not 1 and 1 is not True."""
    return any(
        value == option and isinstance(value, bool) == isinstance(option, bool)
        for option in options
    )


def _either(named: Sequence[object], described: str) -> str:
    """The named values, then what `described` says, None last: "'auto', an int >= 1 or None"."""
    parts = [repr(option) for option in named if option is not None]
    parts += [described] if described else []
    parts += ["None"] if None in named else []
    return parts[0] if len(parts) == 1 else f"{', '.join(parts[:-1])} or {parts[-1]}"


def _message(field: str, valid: str, hint: str | None, value: object) -> str:
    shown = str(value) if isinstance(value, numbers.Number) else repr(value)
    return f"{field} must be {valid}{f' ({hint})' if hint else ''}, got {shown}"
