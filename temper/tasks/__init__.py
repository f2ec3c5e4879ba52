"""Tasks: problem generators with rewards, and `TaskConfig`, the config of any of them.

A job's `task` field is typed `TaskConfig`, so a recipe picks a task by its config class, the
CLI picks one as a subcommand named after the task (`task:arithmetic --task.max_digits 2`), and
config.json, which carries no type tag, tells them apart by their field names: every member's
set of fields must differ from the others' (a test checks it).
"""

from temper.tasks.arithmetic import Arithmetic
from temper.tasks.math_task import Math
from temper.tasks.problem import Problem, Split
from temper.tasks.reverse_text import ReverseText
from temper.tasks.sum_digits import SumDigits

TaskConfig = SumDigits.Config | Arithmetic.Config | ReverseText.Config | Math.Config
"""The config of any task; `config.build()` gives the task."""

__all__ = ["Arithmetic", "Math", "Problem", "ReverseText", "Split", "SumDigits", "TaskConfig"]
