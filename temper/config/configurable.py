"""The `Configurable` pattern: every component owns a nested `Config` dataclass.

    class Sampler(Configurable):
        @dataclass(kw_only=True)
        class Config(Configurable.Config):
            max_batch: int = 64
            '''Most sequences decoded at once.'''

        def __init__(self, config: Config, *, model: nn.Module) -> None: ...

    sampler = Sampler.Config(max_batch=8).build(model=model)

A config is complete before `build()`: the keyword arguments of `build()` are runtime objects
(a model, a tokenizer, a device mesh), never settings, and passing a settings field there is an
error rather than a silent override.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, ClassVar


class Configurable:
    """Base for components built from a nested `Config` dataclass."""

    @dataclasses.dataclass(kw_only=True)
    class Config:
        """Base config; subclasses are `@dataclass(kw_only=True)` nested in their owner."""

        _owner: ClassVar[type | None] = None
        renamed_fields: ClassVar[Mapping[str, str]] = MappingProxyType({})
        """Settings that moved: old field name -> its new path from this config
        (`{"group_size": "rl.group_size"}`), so that the old flag fails naming the new one."""

        def build(self, **runtime_objects: Any) -> Any:
            """Construct the owning component from this config and runtime objects."""
            owner = type(self)._owner
            if owner is None:
                raise TypeError(
                    f"{type(self).__qualname__} is not nested in a Configurable class, "
                    "so it has nothing to build"
                )
            setting_names = {field.name for field in dataclasses.fields(self)}
            misplaced = sorted(setting_names & runtime_objects.keys())
            if misplaced:
                raise TypeError(
                    f"{type(self).__qualname__}.build() got settings {misplaced} as keyword "
                    "arguments; settings belong on the config (e.g. "
                    f"dataclasses.replace(config, {misplaced[0]}=...)), build() takes only "
                    "runtime objects"
                )
            return owner(self, **runtime_objects)

        def missing_packages(self) -> dict[str, str]:
            """Settings of this config (not of nested ones) that need a package that is not
            installed: field name -> what to install. Checked before a job starts
            (`missing_packages` below), so that a run does not fail at its first use."""
            return {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        config_cls = cls.__dict__.get("Config")
        if config_cls is None:
            return  # inherits the parent's Config, which keeps building the parent
        if not (isinstance(config_cls, type) and issubclass(config_cls, Configurable.Config)):
            raise TypeError(f"{cls.__qualname__}.Config must subclass Configurable.Config")
        # is_dataclass() is also true for an undecorated subclass (it inherits the base's
        # fields), whose annotated settings would silently not be fields; look at its own dict.
        if "__dataclass_fields__" not in vars(config_cls):
            raise TypeError(f"{cls.__qualname__}.Config must be a @dataclass(kw_only=True)")
        config_cls._owner = cls


def missing_packages(config: Configurable.Config) -> list[str]:
    """What `config` and the configs nested in it (fields, lists) need installed and is not,
    one line per setting, named by its flag (`--metrics.tensorboard True needs ...`)."""
    lines: list[str] = []

    def visit(value: Any, path: str) -> None:
        if isinstance(value, Configurable.Config):
            for name, need in value.missing_packages().items():
                lines.append(f"--{path}{name} {getattr(value, name)!r} needs {need}")
            for field in dataclasses.fields(value):
                visit(getattr(value, field.name), f"{path}{field.name}.")
        elif isinstance(value, list | tuple):
            for item in value:
                visit(item, path)

    visit(config, "")
    return lines


def renamed_fields(config: Configurable.Config) -> dict[str, str]:
    """The old paths of settings that moved in `config` or the configs nested in it -> their
    new paths (flag names without `--`: `group_size` -> `rl.group_size`)."""
    renamed: dict[str, str] = {}

    def visit(value: Any, path: str) -> None:
        if not isinstance(value, Configurable.Config):
            return
        for old, new in type(value).renamed_fields.items():
            renamed[f"{path}{old}"] = f"{path}{new}"
        for field in dataclasses.fields(value):
            visit(getattr(value, field.name), f"{path}{field.name}.")

    visit(config, "")
    return renamed
