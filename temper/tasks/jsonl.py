"""The one JSONL reader of data files: one JSON value per line, read and checked whole.

GSM8K-format problems (gsm8k_format.py) and SFT conversations (temper/sft/datasets.py) both
read through `read_jsonl`, so their errors read alike: a missing file is a FileNotFoundError
naming the path and what it should hold; malformed JSON, or a value the caller's `parse`
rejects, is a ValueError naming the file and the 1-based line; a file with only blank lines is
a ValueError. Blank lines are skipped (and still counted for line numbers). It lives in tasks/,
the lowest layer that both tasks and sft/ read data in.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

Item = TypeVar("Item")


@dataclass(frozen=True)
class JsonLine:
    """One non-blank line of a JSONL file, parsed."""

    value: Any
    """The line's JSON value, as `json.loads` returns it."""
    path: Path
    number: int
    """1-based line number in the file."""

    @property
    def where(self) -> str:
        """ "path:line", the prefix of every error about this line."""
        return f"{self.path}:{self.number}"


def read_jsonl(
    path: str | Path,
    parse: Callable[[JsonLine], Item],
    *,
    name: str,
    expected: str,
    items: str,
) -> list[Item]:
    """`parse` of every non-blank line of the JSONL file at `path`, in order.

    `name` says which file it is in messages (a config field, "conversation dataset"),
    `expected` what it must hold ('a JSONL file with one {...} object per line') and `items`
    what its lines are ("problems"). `parse` raises ValueError naming `line.where` for a value
    it rejects."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"{name}: no such file {str(path)!r} (resolved: {path.resolve()}); expected {expected}"
        )
    parsed = []
    with path.open(encoding="utf-8") as file:
        for number, text in enumerate(file, start=1):
            if text.strip():
                where = f"{path}:{number}"
                parsed.append(parse(JsonLine(value=_loads(text, where), path=path, number=number)))
    if not parsed:
        raise ValueError(f"{name} {path} holds no {items} (every line is blank)")
    return parsed


def _loads(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        if error.pos >= len(text.rstrip()):
            # json counts the line's newline as a line of its own and would say "column 1".
            raise ValueError(
                f"{where}: malformed JSON (the line ends before the JSON value does); each "
                "record must be a whole JSON object on one line"
            ) from None
        raise ValueError(f"{where}: malformed JSON ({error.msg} at column {error.colno})") from None
