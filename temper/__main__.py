"""The `temper` command and `python -m temper ...` (temper/cli.py), in a process whose OpenMP
threads sleep when idle.

Spinning idle OpenMP threads make small ops 30-190x slower on a busy machine (DESIGN.md,
platform facts), and OpenMP reads `OMP_WAIT_POLICY` once, when torch loads: so it is set here,
before temper.cli imports torch. A value already in the environment is kept.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from temper.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
