"""math: GSM8K-format reading (strict, with line numbers), final-number extraction, reward,
and the shipped sample file."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest

from temper.tasks import Math
from temper.tasks.gsm8k_format import final_number, parse_number, read_gsm8k_jsonl

SAMPLE = Path(__file__).parents[2] / "data" / "gsm8k_sample.jsonl"


def write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def good_line(question: str = "What is 2 + 3?", answer: str = "2 + 3 = 5\n#### 5") -> str:
    return json.dumps({"question": question, "answer": answer})


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so she has 18 left.\n#### 18", 18.0),
        ("#### 1,234", 1234.0),
        ("#### $-3.50", -3.5),
        ("The answer is \\boxed{42}.", 42.0),
        ("first 3 then \\boxed{7} and later 9", 7.0),
        ("She pays 4 * 5 = 20 dollars, then 20 + 2 = 22", 22.0),
        ("#### 12 apples\nthen 99", 12.0),  # the number right after ####
        ("#### 12\nQuestion: Sam has 3 pens.\nAnswer: 3\n#### 3", 12.0),  # the first ####
        ("no digits here", None),
        ("#### none", None),
    ],
)
def test_final_number(text, expected):
    assert final_number(text) == expected


def test_parse_number():
    assert parse_number("about 1,000,000 people") == 1_000_000.0
    assert parse_number("x = .5") == 0.5
    assert parse_number("none") is None


def test_reward_compares_final_numbers(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [good_line(f"Q{i}?") for i in range(40)])
    task = Math.Config(path=str(path)).build()
    problem = task.sample(random.Random(0), split="train")
    assert problem.prompt.startswith("Question: Q") and problem.prompt.endswith("\nAnswer:")
    assert task.reward(problem, problem.answer) == 1.0
    assert task.reward(problem, " 2 + 3 is five, so #### 5.0") == 1.0
    assert task.reward(problem, " The answer is \\boxed{5}") == 1.0
    assert task.reward(problem, " 2 + 3 = 6\n#### 6") == 0.0
    assert task.reward(problem, " I do not know") == 0.0


def test_splits_by_question_hash_or_from_a_heldout_file(tmp_path):
    lines = [good_line(f"Question number {i}?") for i in range(200)]
    task = Math.Config(path=str(write_jsonl(tmp_path / "a.jsonl", lines))).build()
    train = {p.prompt for p in task.problems["train"]}
    heldout = {p.prompt for p in task.problems["heldout"]}
    assert not train & heldout and len(train) + len(heldout) == 200
    assert 5 <= len(heldout) <= 40

    test_path = write_jsonl(tmp_path / "test.jsonl", [good_line("Held out?")])
    task = Math.Config(path=str(tmp_path / "a.jsonl"), heldout_path=str(test_path)).build()
    assert len(task.problems["train"]) == 200
    assert task.sample(random.Random(0), split="heldout").prompt == "Question: Held out?\nAnswer:"


def test_missing_file_names_the_path(tmp_path):
    missing = tmp_path / "nope" / "train.jsonl"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        Math.Config(path=str(missing)).build()
    with pytest.raises(FileNotFoundError, match=r"Math\.Config\.heldout_path"):
        Math.Config(path=str(SAMPLE), heldout_path=str(missing)).build()


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ('{"question": "Q?", "answer": "#### 1"', "malformed JSON"),
        ('["Q?", "#### 1"]', "expected a JSON object, got list"),
        ('{"question": "Q?"}', "missing key 'answer'"),
        ('{"answer": "#### 1"}', "missing key 'question'"),
        ('{"question": 3, "answer": "#### 1"}', "'question' must be a non-empty string"),
        ('{"question": "Q?", "answer": "it is 4"}', "must end with '#### <number>'"),
        ('{"question": "Q?", "answer": "#### four"}', "must end with '#### <number>'"),
    ],
)
def test_malformed_line_names_file_and_line(tmp_path, bad_line, message):
    # Line 4: two good lines, a blank line (skipped but counted), then the bad one.
    path = write_jsonl(tmp_path / "data.jsonl", [good_line(), good_line(), "", bad_line])
    with pytest.raises(ValueError, match=re.escape(f"{path}:4: ") + ".*" + re.escape(message)):
        Math.Config(path=str(path)).build()


def test_empty_file_and_too_few_problems_for_a_split(tmp_path):
    with pytest.raises(ValueError, match="no problems"):
        read_gsm8k_jsonl(write_jsonl(tmp_path / "empty.jsonl", ["", "  "]))
    with pytest.raises(ValueError, match="too few for a 10% held-out split"):
        Math.Config(path=str(write_jsonl(tmp_path / "one.jsonl", [good_line()]))).build()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"path": ""}, "path"),
        ({"prompt_template": "Q: {q}"}, "'{question}' exactly once"),
        ({"heldout_percent": 0}, "heldout_percent"),
    ],
)
def test_bad_config(overrides, message):
    with pytest.raises(ValueError, match=message):
        Math.Config(**{"path": "x.jsonl", **overrides})


def test_sample_file_answers_are_right():
    """Every step `a op b = c` of every shipped solution holds, and the last one is the answer."""
    rows = read_gsm8k_jsonl(SAMPLE)
    assert len(rows) == 50
    for row in rows:
        steps = re.findall(r"(\d+) ([-+*/]) (\d+) = \$?(\d+)", row.solution)
        assert steps, row.solution
        for a, op, b, c in steps:
            value = {"+": int.__add__, "-": int.__sub__, "*": int.__mul__, "/": int.__truediv__}[
                op
            ](int(a), int(b))
            assert value == int(c), row.solution
        assert float(steps[-1][3]) == row.final
        assert row.question.isascii() and row.solution.isascii()
