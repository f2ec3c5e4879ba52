"""README.md and docs/*.md work as printed: their shell commands and Python snippets run.

Every ```bash and ```python block of README.md and docs/*.md is one test (id `README.md:45`,
the line of its opening fence). A block runs in a fresh temporary directory (HOME points into
it, so `~/models/...` lands there too), with this checkout's code first on PYTHONPATH:

- python: the block is one script, run by this interpreter in a fresh process.
- bash: each command (a line; `\\` continues it; `# comments` dropped) runs with bash, in
  order, stopping at the first failure. `temper ...` is `python -m temper ...` from this
  checkout. Only `temper` commands run; any other line (make, pip, torchrun, a benchmark)
  must be marked skip in the markdown. `temper train` runs with the recipe and flags as
  printed plus QUICK_FLAGS (chosen by the job its recipe builds) appended, so a renamed flag
  or recipe fails while a 300-step run takes seconds; `--help`, `--resume` and
  `--config-file` lines get nothing appended.

The markdown says what a block needs, in HTML comments (invisible when rendered) on the lines
right above its fence:

    <!-- docs-check: skip (reason) -->             the block does not run (GPU, a real model,
                                                   a server, a placeholder that cannot run)
    <!-- docs-check: skip "PREFIX" (reason) -->    commands starting with PREFIX do not run
    <!-- docs-check: help "PREFIX" (reason) -->    commands starting with PREFIX run as
                                                   `temper <words before the first flag> --help`
    <!-- docs-check: exits-1 "PREFIX" (reason) -->  commands starting with PREFIX must exit
                                                   with status 1 (a `temper plan` that does
                                                   not fit)
    <!-- docs-check: continues -->                 the previous block of the same kind in this
                                                   file runs first: the same Python script, or
                                                   the same directory for shell commands
    <!-- docs-check: setup "COMMAND" -->           a shell command run first (e.g. to make a
                                                   run directory that placeholders such as
                                                   runs/X refer to)
    <!-- docs-check: stopped-run "COMMAND" -->     a `temper train ... --run-dir DIR` run first
                                                   and stopped with Ctrl-C (SIGINT) once its
                                                   first checkpoint is written, leaving a
                                                   stopped run in DIR for `--resume`

Without a mark, a block is expected to run as printed, and on its own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import NoReturn

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

SHELL_LANGUAGES = {"bash", "sh", "shell"}
TIMEOUT_S = 120
"""Most seconds one command or one Python block may take."""

QUICK_FLAGS = {
    # One sampler process: a helper process per core costs seconds to start.
    "RLJob.Config": "--rl.steps 2 --warmup.steps 2 --eval_problems 8 --metrics.display none "
    "--sampler.cpu.processes 1",
    "SFTJob.Config": "--steps 2 --eval_every 2 --eval_problems 8 --metrics.display none",
}
"""Flags appended to a printed `temper train` command, by the type of its recipe's config."""

_FENCE = re.compile(r"^(```+)\s*([\w+-]*)\s*$")
_MARKER = re.compile(r"^\s*<!--\s*docs-check:\s*(.*?)\s*-->\s*$")
_LINE_RULE = re.compile(r'^(skip|help|exits-1)\s+"([^"]+)"\s*\((.+)\)$')
_SETUP = re.compile(r'^(setup|stopped-run)\s+"(.+)"$')
_BLOCK_SKIP = re.compile(r"^skip\s*\((.+)\)$")


def _fail(message: str) -> NoReturn:
    """Fail with the message alone: the file, line and command say what broke."""
    pytest.fail(message, pytrace=False)


@dataclasses.dataclass
class LineRule:
    action: str  # "skip", "help" or "exits-1"
    prefix: str
    reason: str


@dataclasses.dataclass
class Block:
    doc: str  # path relative to the repository, e.g. "docs/api.md"
    line: int  # line of the opening fence, 1-based
    kind: str  # "python" or "shell"
    code: str
    skip: str | None = None
    continues: bool = False
    line_rules: list[LineRule] = dataclasses.field(default_factory=list)
    setup: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (action, command)
    previous: Block | None = None  # set when `continues`

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"


def parse(path: Path) -> tuple[list[Block], list[str]]:
    """The python and shell blocks of a markdown file with their marks, and marker errors."""
    doc = path.relative_to(REPO).as_posix()
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    errors: list[str] = []
    pending: list[tuple[int, str]] = []  # markers directly above the next line
    i = 0
    while i < len(lines):
        marker = _MARKER.match(lines[i])
        if marker:
            pending.append((i + 1, marker.group(1)))
            i += 1
            continue
        if "docs-check" in lines[i]:
            errors.append(
                f"{doc}:{i + 1}: malformed docs-check marker (one line: <!-- docs-check: ... -->)"
            )
        fence = _FENCE.match(lines[i])
        if not fence:
            errors += [
                f"{doc}:{n}: docs-check marker not directly above a code block" for n, _ in pending
            ]
            pending = []
            i += 1
            continue
        start, ticks, language = i + 1, fence.group(1), fence.group(2).lower()
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == ticks), len(lines))
        kind = (
            "python" if language == "python" else "shell" if language in SHELL_LANGUAGES else None
        )
        if kind is None:
            errors += [
                f"{doc}:{n}: docs-check marker above a ```{language} block" for n, _ in pending
            ]
        else:
            block = Block(doc=doc, line=start, kind=kind, code="\n".join(lines[i + 1 : end]))
            for n, text in pending:
                error = _apply_marker(block, text)
                if error:
                    errors.append(f"{doc}:{n}: {error}")
            if block.continues:
                block.previous = next((b for b in reversed(blocks) if b.kind == kind), None)
                if block.previous is None:
                    errors.append(f"{block.where}: `continues` but no earlier {kind} block")
            blocks.append(block)
        pending = []
        i = end + 1
    errors += [f"{doc}:{n}: docs-check marker at the end of the file" for n, _ in pending]
    return blocks, errors


def _apply_marker(block: Block, text: str) -> str | None:
    """Record one marker on the block; an error message if it is not understood."""
    if text == "continues":
        block.continues = True
    elif match := _BLOCK_SKIP.match(text):
        block.skip = match.group(1)
    elif match := _LINE_RULE.match(text):
        if block.kind != "shell":
            return f"a line rule ({text!r}) on a python block"
        block.line_rules.append(LineRule(match.group(1), match.group(2), match.group(3)))
    elif match := _SETUP.match(text):
        block.setup.append((match.group(1), match.group(2)))
    else:
        return f"unknown docs-check marker {text!r} (see tests/test_docs.py)"
    return None


def shell_commands(code: str) -> list[tuple[int, str]]:
    """(offset of its first line in the block, command) for each command of a shell block."""
    commands: list[tuple[int, str]] = []
    current, first = "", 0
    for offset, line in enumerate(code.splitlines(), start=1):
        if not current:
            first = offset
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        command = " ".join(_strip_comment(current + line).split())
        current = ""
        if command:
            commands.append((first, command))
    return commands


def _strip_comment(line: str) -> str:
    """The line without a `# comment` (a # at a word start, outside quotes)."""
    quote = None
    for index, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (index == 0 or line[index - 1].isspace()):
            return line[:index]
    return line


def _rule_for(block: Block, command: str) -> LineRule | None:
    """The line rule with the longest prefix that the command starts with."""
    rules = [rule for rule in block.line_rules if command.startswith(rule.prefix)]
    return max(rules, key=lambda rule: len(rule.prefix), default=None)


def quick_flags(command: str) -> str:
    """What QUICK_FLAGS appends to a `temper train` command ('' for other commands)."""
    words = shlex.split(command)
    if words[:2] != ["temper", "train"]:
        return ""
    args = words[2:]
    if {"-h", "--help", "--resume", "--config-file"} & set(args):
        return ""
    from temper.config import recipes

    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            if args and not args[0].startswith("-"):
                info = recipes.get_recipe(args[0])
            else:
                info = recipes.default_recipe()
            config = info.fn()
    except (Exception, SystemExit):
        return ""  # an unknown recipe: the command fails as printed, which the test reports
    job = type(config).__qualname__
    if job not in QUICK_FLAGS:
        _fail(f"`{command}`: no QUICK_FLAGS for {job} in tests/test_docs.py")
    return QUICK_FLAGS[job]


def _help_command(command: str) -> str:
    """The command's words before its first flag, then --help."""
    words = shlex.split(command)
    first_flag = next((i for i, word in enumerate(words) if word.startswith("-")), len(words))
    return shlex.join([*words[:first_flag], "--help"])


def _environment(workdir: Path) -> dict[str, str]:
    shims = workdir / ".docs-check-bin"
    shims.mkdir(exist_ok=True)
    temper = shims / "temper"
    temper.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m temper "$@"\n')
    temper.chmod(0o755)
    home = workdir / "home"
    home.mkdir(exist_ok=True)
    env = dict(os.environ)
    env.update(
        PATH=f"{shims}{os.pathsep}{env.get('PATH', '')}",
        PYTHONPATH=os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])]),
        HOME=str(home),
        OMP_WAIT_POLICY=env.get("OMP_WAIT_POLICY", "PASSIVE"),
    )
    return env


def _tail(text: str, lines: int = 30) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _failure(where: str, what: str, result: subprocess.CompletedProcess | None, note: str) -> str:
    message = f"{where}: {what}\n{note}"
    if result is not None:
        message += f"\n--- stderr (tail) ---\n{_tail(result.stderr) or '(empty)'}"
        if not result.stderr.strip():
            message += f"\n--- stdout (tail) ---\n{_tail(result.stdout) or '(empty)'}"
    return message


def _run_checked(
    args: list[str],
    *,
    cwd: Path,
    env: dict[str, str],
    where: str,
    what: str,
    note: str = "",
    status: int = 0,
) -> None:
    """Run `args`; fail naming `where` and `what` on a timeout or an exit status other than
    `status`."""
    try:
        result = subprocess.run(
            args, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        _fail(f"{where}: {what} took more than {TIMEOUT_S} s")
    if result.returncode != status:
        expected = f" (expected {status})" if status else ""
        _fail(_failure(where, what, result, f"exit status {result.returncode}{expected}{note}"))


def _run(command: str, *, cwd: Path, env: dict[str, str], where: str, status: int = 0) -> None:
    _run_checked(
        ["bash", "-c", command], cwd=cwd, env=env, where=where, what=f"`{command}`", status=status
    )


def _stopped_run(command: str, *, cwd: Path, env: dict[str, str], where: str) -> None:
    """Start a `temper train ... --run-dir DIR` and Ctrl-C it after its first checkpoint."""
    words = shlex.split(command)
    if "--run-dir" not in words:
        _fail(f"{where}: stopped-run needs --run-dir: `{command}`")
    state = cwd / words[words.index("--run-dir") + 1] / "run_state" / "state.json"
    process = subprocess.Popen(
        ["bash", "-c", f"exec {command}"],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # A shell's command starts with Ctrl-C at its default; the test process's own
        # signal state (a thread of an earlier test may have blocked or ignored SIGINT) must
        # not leak into the run.
        preexec_fn=_default_sigint,
    )
    deadline = time.monotonic() + TIMEOUT_S
    while process.poll() is None and not state.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    signals = "(it had already exited)"
    if process.poll() is None:
        signals = _signal_masks(process.pid)
        process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=TIMEOUT_S)
    result = subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
    if process.returncode != 130 or not state.exists():
        note = (
            f"exit status {process.returncode}; expected 130, stopped by Ctrl-C after its first "
            f"checkpoint (a run that finishes first needs more steps); when signalled: {signals}"
        )
        _fail(_failure(where, f"stopped-run `{command}`", result, note))


def _default_sigint() -> None:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _signal_masks(pid: int) -> str:
    """The process's blocked, ignored and caught signal masks (Linux /proc), for a failure."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return "(no /proc)"
    return ", ".join(line for line in lines if line.startswith(("SigBlk", "SigIgn", "SigCgt")))


def _python_script(chain: list[Block]) -> str:
    """The blocks as one script whose line numbers are those of the markdown file."""
    script: list[str] = []
    for block in chain:
        script += [""] * (block.line - len(script))
        script += block.code.splitlines()
    return "\n".join(script) + "\n"


def run_block(block: Block, workdir: Path) -> list[str]:
    """Run a block (after the blocks it continues); the reasons of commands it skipped."""
    chain = [block]
    while chain[0].previous is not None:
        chain.insert(0, chain[0].previous)
    skipped_by = next((b for b in chain if b.skip), None)
    if skipped_by is not None:
        reason = (
            skipped_by.skip
            if skipped_by is block
            else f"continues {skipped_by.where}: {skipped_by.skip}"
        )
        pytest.skip(f"{block.where}: {reason}")
    env = _environment(workdir)
    for part in chain:
        for action, command in part.setup:
            where = f"{part.where} (setup)"
            if action == "stopped-run":
                _stopped_run(command, cwd=workdir, env=env, where=where)
            else:
                _run(command, cwd=workdir, env=env, where=where)
    if block.kind == "python":
        script = workdir / (Path(block.doc).name + ".py")
        script.write_text(_python_script(chain))
        _run_checked(
            [sys.executable, script.name],
            cwd=workdir,
            env=env,
            where=block.where,
            what="the python block",
            note=f"; traceback line numbers are lines of {block.doc}",
        )
        return []
    skipped: list[str] = []
    for part in chain:
        for offset, command in shell_commands(part.code):
            where = f"{part.doc}:{part.line + offset}"
            rule = _rule_for(part, command)
            if rule is not None and rule.action == "skip":
                if part is block:
                    skipped.append(f"`{command}`: {rule.reason}")
                continue
            if rule is not None and rule.action == "help":
                command = _help_command(command)
            if not command.startswith("temper "):
                _fail(
                    f"{where}: `{command}` is not a `temper` command; mark it in the markdown "
                    '(<!-- docs-check: skip "PREFIX" (reason) -->)'
                )
            flags = quick_flags(command) if rule is None else ""
            status = 1 if rule is not None and rule.action == "exits-1" else 0
            _run(f"{command} {flags}".strip(), cwd=workdir, env=env, where=where, status=status)
    return skipped


def _collect() -> tuple[list[Block], list[str]]:
    blocks: list[Block] = []
    errors: list[str] = []
    for path in DOCS:
        found, problems = parse(path)
        blocks += found
        errors += problems
    return blocks, errors


BLOCKS, MARKER_ERRORS = _collect()


def test_markers_are_well_formed():
    assert not MARKER_ERRORS, "\n".join(MARKER_ERRORS)


@pytest.mark.parametrize("block", BLOCKS, ids=[block.where for block in BLOCKS])
def test_block_runs_as_printed(block: Block, tmp_path: Path):
    skipped = run_block(block, tmp_path)
    ran = block.kind == "python" or len(skipped) < len(shell_commands(block.code))
    if not ran:
        pytest.skip(f"{block.where}: " + "; ".join(skipped))
