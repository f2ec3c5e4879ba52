"""math: word problems from a GSM8K-format JSONL file, rewarded by their final number.

The prompt is plain text (no chat template): `prompt_template` with the question filled in. The
reference answer, which the supervised warm-up trains on, is the file's worked solution ending
in `#### <number>`; the reward extracts the final number of a completion (`gsm8k_format.
final_number`) and compares it numerically. The file is read and checked when the task is
built, so a missing file or a malformed line stops a run before any training.

Held-out problems come from `heldout_path` (e.g. GSM8K's test file) or, without one, from a
hash of each question in `path`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from temper.config.checks import check_range
from temper.config.configurable import Configurable
from temper.config.local_paths import LOCAL_PATH
from temper.tasks.gsm8k_format import MathRow, final_number, read_gsm8k_jsonl, same_number
from temper.tasks.problem import Problem, Split, split_of

QUESTION_SLOT = "{question}"


class Math(Configurable):
    @dataclass(kw_only=True)
    class Config(Configurable.Config):
        path: str = field(metadata=LOCAL_PATH)
        """GSM8K-format JSONL file: one {"question": ..., "answer": "... #### 42"} per line."""
        heldout_path: str | None = field(default=None, metadata=LOCAL_PATH)
        """A separate held-out file (e.g. GSM8K's test split); unset: hold out by hash."""
        heldout_percent: int = 10
        """Without `heldout_path`: share of `path`'s questions (by hash) held out, in percent."""
        prompt_template: str = "Question: {question}\nAnswer:"
        """The prompt; '{question}' is replaced by the question."""

        def __post_init__(self) -> None:
            if not self.path:
                raise ValueError("Math.Config.path must name a JSONL file, got ''")
            if self.prompt_template.count(QUESTION_SLOT) != 1:
                raise ValueError(
                    f"Math.Config.prompt_template must contain {QUESTION_SLOT!r} exactly once, "
                    f"got {self.prompt_template!r}"
                )
            check_range(
                self.heldout_percent,
                field="Math.Config.heldout_percent",
                integer=True,
                at_least=1,
                at_most=99,
            )

    def __init__(self, config: Config) -> None:
        self.config = config
        rows = read_gsm8k_jsonl(config.path, field="Math.Config.path")
        if config.heldout_path is None:
            train = [r for r in rows if self._split_of(r) == "train"]
            heldout = [r for r in rows if self._split_of(r) == "heldout"]
        else:
            train = rows
            heldout = read_gsm8k_jsonl(config.heldout_path, field="Math.Config.heldout_path")
        if not train or not heldout:
            raise ValueError(
                f"Math.Config: {config.path} has {len(rows)} problems, too few for a "
                f"{config.heldout_percent}% held-out split (train {len(train)}, held-out "
                f"{len(heldout)}); add problems or set heldout_path"
            )
        self.problems: dict[Split, list[Problem]] = {
            "train": [self._problem(r) for r in train],
            "heldout": [self._problem(r) for r in heldout],
        }

    def _split_of(self, row: MathRow) -> Split:
        return split_of(row.question, heldout_percent=self.config.heldout_percent)

    def _problem(self, row: MathRow) -> Problem:
        prompt = self.config.prompt_template.replace(QUESTION_SLOT, row.question)
        # A leading space: BPE vocabularies tokenize " word" after "Answer:" as one piece.
        return Problem(prompt=prompt, answer=f" {row.solution}")

    def sample(self, rng: random.Random, *, split: Split) -> Problem:
        """One problem of `split`, uniformly at random (with replacement)."""
        return rng.choice(self.problems[split])

    def reward(self, problem: Problem, completion: str) -> float:
        """1.0 when the completion's final number equals the reference's, else 0.0."""
        expected, got = final_number(problem.answer), final_number(completion)
        assert expected is not None, "reference answers are checked when the file is read"
        return 1.0 if got is not None and same_number(got, expected) else 0.0
