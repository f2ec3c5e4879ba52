"""copy_weights: a checkpoint copied into a run of the caller's, sharing the source's bytes.

The copy is a new run (`run.json` names the source's base model and LoRA shape, the new owner
and the source it came from) holding one checkpoint of the source's kind and name. Its files
are hard links to the source's where the file system allows (no byte is stored twice; either
side deleted leaves the other whole), else copies. A copy run has no live model: it is read
(sampled, loaded into a new training model, copied, downloaded), never trained in place.

The SDK sends an `X-Idempotency-Key` per copy and resends it on retries; a key seen in the
last `MAX_REMEMBERED` copies answers with the copy it made.
"""

from __future__ import annotations

import os
import shutil
import threading
from collections import OrderedDict
from typing import Any

from temper.checkpoint.atomic import staged_directory
from temper.checkpoint.storage import CheckpointPath, CheckpointStorage

MAX_REMEMBERED = 1024
"""Idempotency keys remembered (a retry comes seconds after its first try)."""


class CheckpointCopies:
    def __init__(self, storage: CheckpointStorage) -> None:
        self.storage = storage
        self._lock = threading.Lock()
        self._by_key: OrderedDict[tuple[str, str], CheckpointPath] = OrderedDict()

    def known(self, key: str | None, *, owner: str) -> CheckpointPath | None:
        """The copy an earlier request with this idempotency key made, if it still exists."""
        if key is None:
            return None
        with self._lock:
            copied = self._by_key.get((owner, key))
        if copied is None or not self.storage.directory(copied).is_dir():
            return None
        return copied

    def copy(
        self,
        source: CheckpointPath,
        *,
        run_id: str,
        source_run: dict[str, Any],
        owner: str,
        key: str | None,
        extra: dict[str, Any],
    ) -> CheckpointPath:
        """Copy `source` into the new run `run_id` (which must not exist) for `owner`."""
        target = CheckpointPath(run_id, source.kind, source.name)
        run = {
            "base_model": source_run["base_model"],
            "lora": source_run.get("lora"),
            "owner": owner,
            "copied_from": str(source),
            **extra,
        }
        directory = self.storage.directory(target)
        directory.parent.mkdir(parents=True)  # the run's kind folder; fails if the run exists
        with staged_directory(directory) as staging:
            shutil.copytree(
                self.storage.directory(source),
                staging,
                copy_function=_link_or_copy,
                dirs_exist_ok=True,
            )
        self.storage.write_run(run_id, run)
        if key is not None:
            with self._lock:
                self._by_key[(owner, key)] = target
                while len(self._by_key) > MAX_REMEMBERED:
                    self._by_key.popitem(last=False)
        return target


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)
