"""The `temper` command and `python -m temper ...` (temper/cli.py), in a process whose OpenMP
threads sleep when idle.

Spinning idle OpenMP threads make small ops 30-190x slower on a busy machine (DESIGN.md,
platform facts), and OpenMP reads `OMP_WAIT_POLICY` once, when torch loads: so it is set here,
before temper.cli imports torch. A value already in the environment is kept.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from temper import cli


def main() -> int:
    """The `temper` command (cli.main); a reader that goes away early (`temper ... | head`)
    ends it quietly, as it does any other command-line tool."""
    try:
        code = cli.main()
        sys.stdout.flush()
    except BrokenPipeError:
        # Point stdout at devnull so that Python's own flush at exit does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    return code


if __name__ == "__main__":
    raise SystemExit(main())
