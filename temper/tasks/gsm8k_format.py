"""GSM8K-format JSONL: one `{"question": "...", "answer": "... #### 42"}` object per line.

The answer is a worked solution whose final number follows `####` (as in GSM8K). Reading is
strict (through the shared JSONL reader, jsonl.py): every problem in the file is checked when
the file is read, and a bad line is a ValueError naming the file and the 1-based line number,
so a run fails before it trains. Blank lines are skipped. `final_number` also reads a model's
completion, which may give its answer after `####`, in `\\boxed{...}`, or just as its last
number.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from temper.tasks.jsonl import JsonLine, read_jsonl

ANSWER_MARK = "####"
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+")
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


@dataclass(frozen=True)
class MathRow:
    question: str
    solution: str
    """The full answer text, ending in `#### <number>`."""
    final: float
    """The number after `####`."""
    line: int
    """1-based line number in the file, for messages."""


def parse_number(text: str) -> float | None:
    """The first number in `text` ("1,200" -> 1200.0, "$-3.5" -> -3.5), or None."""
    match = _NUMBER.search(text)
    return float(match.group().replace(",", "")) if match else None


def final_number(text: str) -> float | None:
    """The answer a text gives: the number after its first `####`, else in its last
    `\\boxed{}`, else its last number; None when there is none.

    The first `####` ends a GSM8K answer; a model that runs on past it (a new "Question: ...",
    with more numbers) is still scored on the answer it gave."""
    if ANSWER_MARK in text:
        return parse_number(text.partition(ANSWER_MARK)[2])
    boxed = _BOXED.findall(text)
    if boxed:
        return parse_number(boxed[-1])
    numbers = _NUMBER.findall(text)
    return float(numbers[-1].replace(",", "")) if numbers else None


def same_number(a: float, b: float) -> bool:
    """Equal up to float rounding of the decimal text (GSM8K answers are mostly integers)."""
    return abs(a - b) <= 1e-6 * max(1.0, abs(b))


def read_gsm8k_jsonl(path: str | Path, *, field: str = "path") -> list[MathRow]:
    """Every problem of a GSM8K-format file; `field` names the config field in messages."""
    return read_jsonl(
        path,
        _parse_line,
        name=field,
        expected='a GSM8K-format JSONL file with one {"question": ..., "answer": "... #### 42"} '
        "per line",
        items="problems",
    )


def _parse_line(line: JsonLine) -> MathRow:
    where, record = line.where, line.value
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    for key in ("question", "answer"):
        if key not in record:
            raise ValueError(f"{where}: missing key {key!r} (keys: {sorted(record)})")
        if not isinstance(record[key], str) or not record[key].strip():
            raise ValueError(f"{where}: {key!r} must be a non-empty string, got {record[key]!r}")
    answer = record["answer"]
    final = final_number(answer) if ANSWER_MARK in answer else None
    if final is None:
        raise ValueError(
            f"{where}: the answer must end with '{ANSWER_MARK} <number>', got ...{answer[-40:]!r}"
        )
    return MathRow(question=record["question"], solution=answer, final=final, line=line.number)
