"""Write a directory whole or not at all.

Everything is written into a hidden staging directory next to the target, which is renamed
into place only when complete; a crash or error leaves the previous contents (or nothing)
and no staging directory. An existing target is moved aside first and removed only after the
new one is in place, so a failed rename puts it back.

A process killed in the middle leaves its hidden directories behind: `clear_interrupted`
removes staging directories and puts a moved-aside target back where the new one never
arrived.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def staged_directory(target: str | Path) -> Iterator[Path]:
    """Yield an empty directory to write into; on success it replaces `target`."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield staging
        _move_into_place(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _move_into_place(staging: Path, target: Path) -> None:
    if not target.exists():
        os.replace(staging, target)
        return
    retired = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
    os.replace(target, retired)  # renaming onto the empty mkdtemp directory is allowed (POSIX)
    try:
        os.replace(staging, target)
    except BaseException:
        os.replace(retired, target)
        raise
    shutil.rmtree(retired)


def check_free(target: str | Path, *, overwrite: bool) -> Path:
    """Refuse to replace a non-empty directory unless `overwrite`."""
    target = Path(target)
    if target.exists() and any(target.iterdir()) and not overwrite:
        raise FileExistsError(
            f"{target} exists and is not empty; pass overwrite=True to replace it (--overwrite "
            "on the command line)"
        )
    return target


def clear_interrupted(parent: str | Path, *, older_than_s: float = 0.0) -> list[Path]:
    """Clean up after `staged_directory` calls in `parent` that a killed process never
    finished; returns the directories removed or put back.

    A staging directory (`.NAME.tmp-*`) is removed; a moved-aside target (`.NAME.old-*`) goes
    back to NAME if NAME is missing (the kill came between the two renames), else it is
    removed. Only entries untouched for `older_than_s` seconds are handled, so a writer in
    another process that is still saving keeps its staging directory."""
    parent = Path(parent)
    if not parent.is_dir():
        return []
    handled = []
    now = time.time()
    for entry in sorted(parent.iterdir()):
        name, kind = _staged_name(entry.name)
        if name is None or not entry.is_dir():
            continue
        try:
            if now - entry.stat().st_mtime < older_than_s:
                continue
            if kind == "old" and not (parent / name).exists():
                os.replace(entry, parent / name)
            else:
                shutil.rmtree(entry)
        except FileNotFoundError:  # another rank of the same job handled it first
            continue
        handled.append(entry)
    return handled


def _staged_name(entry: str) -> tuple[str | None, str]:
    """('NAME', 'tmp' | 'old') for a directory `staged_directory` made, else (None, '')."""
    if not entry.startswith("."):
        return None, ""
    for kind in ("tmp", "old"):
        name, marker, suffix = entry[1:].rpartition(f".{kind}-")
        if marker and name and suffix:
            return name, kind
    return None, ""
