"""Built-in multi-turn environments, and `EnvConfig`, the config of any of them.

A job's `env` field is typed `EnvConfig | None`; config.json tells the members apart by their
field names, so each member's set of fields must differ from the others'.
"""

from temper.rl.envs.guess_number import GuessNumber, GuessNumberEnv
from temper.rl.envs.tool_arithmetic import ToolArithmetic, ToolArithmeticEnv, calculate

EnvConfig = GuessNumber.Config | ToolArithmetic.Config
"""The config of any built-in env source; `config.build(tokenizer=...)` gives the source."""

__all__ = [
    "EnvConfig",
    "GuessNumber",
    "GuessNumberEnv",
    "ToolArithmetic",
    "ToolArithmeticEnv",
    "calculate",
]
