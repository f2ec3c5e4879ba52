"""The code passes ruff (lint and format), so style is enforced by `make test` and CI."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TARGETS = ["temper", "recipes", "tests", "bench"]


def _ruff() -> str:
    beside_python = Path(sys.executable).with_name("ruff")
    found = str(beside_python) if beside_python.exists() else shutil.which("ruff")
    if found is None:
        pytest.skip("ruff is not installed (it comes with the test extra)")
    return found


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["check", "format"])
def test_ruff(command):
    result = subprocess.run(
        [_ruff(), *command, *TARGETS], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
