"""Config fields that name local files or directories, made absolute when a run starts.

A run's config.json is read again from other working directories (`temper train --config-file`,
`--resume`), so a path typed relative to where the run started is saved by its absolute path.
A field opts in with `field(..., metadata=LOCAL_PATH)`. A value that names nothing on disk (a
named size such as 'tiny', or a typo the job reports when it opens it) stays as typed.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import MappingProxyType
from typing import Any

LOCAL_PATH = MappingProxyType({"local_path": True})
"""Field metadata: the field's str value may be a path relative to the working directory."""


def make_local_paths_absolute(config: Any) -> None:
    """In place: every `LOCAL_PATH` field of `config` and of the configs inside it (in fields,
    lists, tuples and dict values) that names an existing relative path gets its absolute path."""
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        for field in dataclasses.fields(config):
            value = getattr(config, field.name)
            if field.metadata.get("local_path") and isinstance(value, str):
                setattr(config, field.name, _absolute(value))
            else:
                make_local_paths_absolute(value)
    elif isinstance(config, list | tuple):
        for item in config:
            make_local_paths_absolute(item)
    elif isinstance(config, dict):
        for item in config.values():
            make_local_paths_absolute(item)


def _absolute(value: str) -> str:
    path = Path(value)
    if not value or path.is_absolute() or not path.exists():
        return value
    return str(path.resolve())
