"""Tools: a timeout per call, errors become failed results, and the tool-use env turns a
failed call into an observation (never an exception)."""

from __future__ import annotations

import time

import pytest

from temper.rl.envs import ToolArithmetic, calculate
from temper.rl.tools import ToolRunner
from temper.tokenizer import build_builtin_tokenizer


def _slow(argument: str) -> str:
    time.sleep(0.5)
    return argument


def _broken(argument: str) -> str:
    raise ValueError(f"bad {argument}")


def test_tool_runner_reports_timeouts_and_exceptions_as_failed_results():
    runner = ToolRunner(_slow, name="slow", timeout_s=0.05)
    result = runner.call("x")
    assert not result.ok and result.timed_out and "timeout" in result.text
    result = ToolRunner(_broken, name="broken", timeout_s=1.0).call("7")
    assert not result.ok and not result.timed_out and result.text == "ValueError: bad 7"
    assert ToolRunner(calculate, name="calc", timeout_s=1.0).call("2*(3+4)").text == "14"


@pytest.mark.parametrize("expression", ["__import__('os')", "2**99", "1+", "(1"])
def test_calculator_refuses_anything_but_integer_arithmetic(expression):
    with pytest.raises((ValueError, SyntaxError)):
        calculate(expression)


def test_a_failed_call_is_an_observation_and_the_episode_goes_on():
    tokenizer = build_builtin_tokenizer("digits")
    source = ToolArithmetic.Config().build(tokenizer=tokenizer)
    (env,) = source.heldout_envs(1)
    eos = tokenizer.eos_token_id
    step = env.step([*tokenizer.encode("?1+"), eos])
    assert not step.done and tokenizer.decode(step.next_observation) == "=?\n"
    assert step.metrics == {"tool_calls": 1.0, "tool_failures": 1.0}
    step = env.step([*tokenizer.encode("?" + env.expression), eos])
    assert tokenizer.decode(step.next_observation) == f"={sum(env.terms)}\n"
    step = env.step([*tokenizer.encode(str(sum(env.terms))), eos])
    assert step.done and step.reward == 1.0 and step.metrics["correct"] == 1.0
