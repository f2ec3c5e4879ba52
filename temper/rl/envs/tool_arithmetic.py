"""Tool-use arithmetic: sums too long to add up reliably in one's head, and a calculator.

    482+937+65=?482+937+65<eos>=1484\n1484<eos>

The initial observation is the problem. An action starting with "?" calls the calculator with
the rest as its expression (temper/tokenizer/renderers/tool_calls.py); the env runs it through a
`ToolRunner` (a timeout per call) and answers "=<result>\n", or "=?\n" when the expression is
not valid or the call failed, which counts as a tool failure and the episode goes on. Any other
action is the final answer: reward 1 if it is the sum, else 0, and the episode ends. The
calculator may be asked for sub-results ("?482+937") as well as the whole sum.

Demonstrations call the calculator on the whole expression and copy its result, except a
`direct_share` of them that answer at once (and often wrongly: the warm-up cannot teach this
model to add three numbers); RL has to find out which pays.
"""

from __future__ import annotations

import ast
import operator
import random
from collections.abc import Sequence
from dataclasses import dataclass

from temper.config.checks import check_range, check_span
from temper.config.configurable import Configurable
from temper.rl.env import Demonstration, StepResult, Turns
from temper.rl.tools import ToolRunner
from temper.tasks.problem import split_of
from temper.tokenizer import Tokenizer
from temper.tokenizer.renderers.tool_calls import ToolCallFormat

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calculate(expression: str) -> str:
    """An integer expression of + - * and parentheses (no names, no calls, no powers)."""
    tree = ast.parse(expression.strip(), mode="eval")

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError(f"not a + - * expression: {expression!r}")

    return str(value(tree.body))


class ToolArithmeticEnv:
    def __init__(self, terms: Sequence[int], *, source: ToolArithmetic) -> None:
        self.terms, self.source = list(terms), source

    @property
    def expression(self) -> str:
        return "+".join(map(str, self.terms))

    def initial_observation(self) -> list[int]:
        return self.source.tokenizer.encode(self.expression + "=")

    def stop_token_ids(self) -> list[int]:
        return [self.source.tokenizer.eos_token_id]

    def step(self, action_tokens: Sequence[int]) -> StepResult:
        source = self.source
        argument = source.format.parse_call(source.tokenizer, action_tokens)
        if argument is None:
            text = source.tokenizer.decode(list(action_tokens), skip_special_tokens=True)
            correct = float(text.strip() == str(sum(self.terms)))
            return StepResult(reward=correct, done=True, metrics={"correct": correct})
        result = source.tool.call(argument)
        observation = source.format.result_tokens(
            source.tokenizer, result.text if result.ok else None
        )
        return StepResult(
            reward=0.0,
            done=False,
            next_observation=observation,
            metrics={"tool_calls": 1.0, "tool_failures": float(not result.ok)},
        )


class ToolArithmetic(Configurable):
    @dataclass(kw_only=True)
    class Config(Configurable.Config):
        num_terms: int = 3
        """Numbers added in a problem."""
        min_digits: int = 2
        """Fewest digits of a number."""
        max_digits: int = 3
        """Most digits of a number."""
        heldout_percent: int = 10
        """Share of problems (by hash) kept for held-out evaluation, in percent."""
        tool_timeout_s: float = 1.0
        """Longest a calculator call may run before it counts as failed."""
        direct_share: float = 0.5
        """Share of demonstrations that answer without the calculator."""

        def __post_init__(self) -> None:
            owner = "ToolArithmetic.Config"
            check_span(
                owner,
                low=("min_digits", self.min_digits),
                high=("max_digits", self.max_digits),
                at_least=1,
            )
            check_range(
                self.heldout_percent,
                field=f"{owner}.heldout_percent",
                integer=True,
                at_least=1,
                at_most=99,
            )
            check_range(self.num_terms, field=f"{owner}.num_terms", at_least=2)
            check_range(self.tool_timeout_s, field=f"{owner}.tool_timeout_s", greater_than=0)
            check_range(self.direct_share, field=f"{owner}.direct_share", at_least=0, at_most=1)

    turns: Turns = "multi"
    """An env source (temper/rl/env.py) of multi-turn episodes."""

    def __init__(self, config: Config, *, tokenizer: Tokenizer) -> None:
        self.config, self.tokenizer = config, tokenizer
        self.format = ToolCallFormat()
        self.tool = ToolRunner(calculate, name="calculator", timeout_s=config.tool_timeout_s)

    def _terms(self, rng: random.Random, *, split: str) -> list[int]:
        config = self.config
        while True:
            terms = []
            for _ in range(config.num_terms):
                digits = rng.randint(config.min_digits, config.max_digits)
                terms.append(rng.randint(10 ** (digits - 1), 10**digits - 1))
            key = "+".join(map(str, terms))
            if split_of(key, heldout_percent=config.heldout_percent) == split:
                return terms

    def make_group(
        self, rng: random.Random, *, split: str, group_size: int
    ) -> list[ToolArithmeticEnv]:
        terms = self._terms(rng, split=split)
        return [ToolArithmeticEnv(terms, source=self) for _ in range(group_size)]

    def heldout_envs(self, count: int) -> list[ToolArithmeticEnv]:
        draws = [random.Random(f"heldout-{i}") for i in range(count)]
        return [ToolArithmeticEnv(self._terms(d, split="heldout"), source=self) for d in draws]

    def demonstration(self, rng: random.Random) -> Demonstration:
        env = ToolArithmeticEnv(self._terms(rng, split="train"), source=self)
        tokenizer, eos = self.tokenizer, self.tokenizer.eos_token_id
        tokens = env.initial_observation()
        weights = [0.0] * len(tokens)
        answer = str(sum(env.terms))
        if rng.random() >= self.config.direct_share:
            call = self.format.call_tokens(tokenizer, env.expression)
            result = self.format.result_tokens(tokenizer, answer)
            tokens += call + result
            weights += [1.0] * len(call) + [0.0] * len(result)
        final = [*tokenizer.encode(answer), eos]
        return Demonstration(tokens=tokens + final, weights=weights + [1.0] * len(final))
