"""One benchmark at two revisions, side by side in one run: is a change slower than before?

Checks out `--base` (a git revision) into a temporary worktree, then runs the benchmark script
`--rounds` times at each revision, alternating which runs first, each side with its own copy of
the script and of `temper/` (so renamed modules and flags on either side are fine). Every run
prints one JSON line; this prints one JSON line with, for each numeric field (nested fields
joined by '/', list items by their index), the median at each revision and head/base.

    OMP_WAIT_POLICY=PASSIVE python bench/revisions.py --base HEAD~3 -- bench/sampler.py --quick

A ratio above 1 means the field's value grew at the head revision (slower, for a time; faster,
for a rate). Runs share the machine; compare ratios against the spread of `--rounds`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def numeric_fields(value: object, prefix: str = "") -> Iterator[tuple[str, float]]:
    """(path, number) for every number in a JSON value; bools and strings are skipped."""
    if isinstance(value, bool):
        return
    if isinstance(value, int | float):
        yield prefix, float(value)
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from numeric_fields(item, f"{prefix}/{key}" if prefix else str(key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from numeric_fields(item, f"{prefix}/{index}" if prefix else str(index))


def run_once(tree: Path, script_args: list[str]) -> dict:
    environment = {**os.environ, "PYTHONPATH": str(tree)}
    environment.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    result = subprocess.run(
        [sys.executable, *script_args],
        cwd=tree,
        env=environment,
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(script_args)} failed in {tree}:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--base", required=True, help="git revision to compare against")
    parser.add_argument("--rounds", type=int, default=3, help="runs per revision")
    parser.add_argument("script", nargs=argparse.REMAINDER, help="-- bench/X.py [its flags]")
    args = parser.parse_args()
    script_args = args.script[1:] if args.script[:1] == ["--"] else args.script
    if not script_args:
        parser.error("give the benchmark after '--', e.g. -- bench/sampler.py --quick")
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    head_revision = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="temper-base-") as directory:
        base_tree = Path(directory) / "tree"
        subprocess.run(
            ["git", "worktree", "add", "--detach", "--quiet", str(base_tree), args.base],
            cwd=ROOT,
            check=True,
        )
        try:
            runs: dict[str, list[dict]] = {"base": [], "head": []}
            for round_index in range(args.rounds):
                sides = [("base", base_tree), ("head", ROOT)]
                if round_index % 2:
                    sides.reverse()
                for name, tree in sides:
                    runs[name].append(run_once(tree, script_args))
                    print(f"round {round_index + 1}/{args.rounds}: {name} done", file=sys.stderr)
        finally:
            subprocess.run(
                ["git", "worktree", "remove", "--force", str(base_tree)], cwd=ROOT, check=False
            )
    values: dict[str, dict[str, list[float]]] = {}
    for name, reports in runs.items():
        for report in reports:
            for path, number in numeric_fields(report):
                values.setdefault(path, {"base": [], "head": []})[name].append(number)
    fields = {}
    for path, sides in values.items():
        if len(sides["base"]) != args.rounds or len(sides["head"]) != args.rounds:
            continue  # a field only one revision reports
        base, head = statistics.median(sides["base"]), statistics.median(sides["head"])
        if base == head and len(set(sides["base"] + sides["head"])) == 1:
            continue  # a constant of the configuration (batch, threads, ...)
        fields[path] = {
            "base": round(base, 6),
            "head": round(head, 6),
            "head_over_base": round(head / base, 3) if base else None,
        }
    print(
        json.dumps(
            {
                "bench": "revisions",
                "script": script_args,
                "base": args.base,
                "head": head_revision,
                "rounds": args.rounds,
                "fields": fields,
            }
        )
    )


if __name__ == "__main__":
    main()
