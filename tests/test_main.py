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


def test_a_reader_that_goes_away_ends_the_command_quietly():
    # `temper plan --help | head -1`, with the reader gone before the help is written.
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = subprocess.run(
            [sys.executable, "-m", "temper", "plan", "--help"],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        os.close(write_end)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
