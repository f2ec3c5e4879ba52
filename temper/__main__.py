"""`python -m temper ...` runs the `temper` command line (temper/cli.py)."""

from __future__ import annotations

from temper.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
