"""Write a directory whole or not at all.

Everything is written into a hidden staging directory next to the target, which is renamed
into place only when complete; a crash or error leaves the previous contents (or nothing)
and no staging directory. An existing target is moved aside first and removed only after the
new one is in place, so a failed rename puts it back.
"""

from __future__ import annotations

import os
import shutil
import tempfile
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
