"""Tasks: problem generators with rewards."""

from temper.rl.tasks.sum_digits import Problem, SumDigits

__all__ = ["Problem", "SumDigits"]
