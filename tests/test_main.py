"""The `temper` command sets OMP_WAIT_POLICY=PASSIVE before torch loads (temper/__main__.py),
and `import temper` alone loads nothing heavy until a public name is used."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHECK = """
import os, sys
import temper
assert "torch" not in sys.modules, "import temper loaded torch"
import temper.__main__
print(os.environ["OMP_WAIT_POLICY"], temper.ServiceClient.__name__)
"""


def _run(environment: dict[str, str]) -> str:
    result = subprocess.run(
        [sys.executable, "-c", CHECK],
        env={**environment, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_the_command_sets_a_passive_wait_policy_unless_one_is_set():
    environment = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    assert _run(environment) == "PASSIVE ServiceClient"
    assert _run({**environment, "OMP_WAIT_POLICY": "ACTIVE"}) == "ACTIVE ServiceClient"
