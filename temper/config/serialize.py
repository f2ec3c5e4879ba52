"""Configs to and from JSON, strictly: a saved run must rebuild exactly the config it ran with.

`config_to_dict` walks values (not annotations) and writes plain JSON types. `config_from_dict`
walks the annotations (resolved with `typing.get_type_hints`, since modules use
`from __future__ import annotations`) and accepts nothing it has to guess about: an unknown key,
a missing key or a value of the wrong type is a `ValueError` naming the dotted field path. No
field falls back to its default, because a default that changed between versions would silently
change a reproduced run. The only conversions are the lossless ones JSON forces: int -> float,
list -> tuple, str -> Path/Enum. bool is not an int here.

A union of several dataclasses carries no type tag on disk; the member whose fields are exactly
the saved keys is chosen, and two members with the same field names are rejected as ambiguous.
A value of a class the union does not name (your own task or env source in a recipe file, which
the job runs like a built-in one) is saved with its class under `CLASS_KEY`, and loads back only
from a module already imported: the recipe's own, which loading the run's recipe imports.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import json
import pathlib
import sys
import types
import typing
from typing import Any, Literal

import temper.config.recipes as recipes

# Config classes are imported by name from a file, so only trusted packages are importable;
# a recipe given as "module:function" also vouches for the module it came from.
TRUSTED_PACKAGES = ("temper", recipes.RECIPES_PACKAGE)


@dataclasses.dataclass(frozen=True)
class LoadedConfig:
    """A config read back by `load_config`, with the recipe it was made from."""

    recipe: str | None
    config: Any


def config_to_dict(config: Any) -> dict[str, Any]:
    """The JSON-safe dict of a dataclass config, fields in declaration order."""
    if not dataclasses.is_dataclass(config) or isinstance(config, type):
        raise TypeError(f"config_to_dict needs a dataclass instance, got {config!r}")
    return _to_json(config, path="")


CLASS_KEY = "__config_class__"
"""The key naming the class of a saved union value that is none of the union's members."""


def _to_json(value: Any, *, path: str) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        try:
            hints = typing.get_type_hints(type(value))
        except NameError:  # an annotation only a type checker resolves: nothing to tag
            hints = {}
        saved = {}
        for field in dataclasses.fields(value):
            if field.init:
                item = getattr(value, field.name)
                saved[field.name] = _to_json(item, path=_join(path, field.name))
                if _outside_union(hints.get(field.name), item):
                    saved[field.name] = {CLASS_KEY: _class_name(type(item)), **saved[field.name]}
        return saved
    # Enum before str/int: a StrEnum is also a str, but its value is what gets saved.
    if isinstance(value, enum.Enum):
        return _to_json(value.value, path=path)
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, pathlib.PurePath):
        return str(value)
    if isinstance(value, list | tuple):
        return [_to_json(item, path=f"{path}[{index}]") for index, item in enumerate(value)]
    if isinstance(value, dict):
        bad_keys = [key for key in value if not isinstance(key, str)]
        if bad_keys:
            raise TypeError(f"field '{path}': dict keys must be str for JSON, got {bad_keys[0]!r}")
        return {key: _to_json(item, path=f"{path}[{key!r}]") for key, item in value.items()}
    raise TypeError(
        f"field '{path}': cannot save {type(value).__qualname__} value {value!r} as JSON; "
        "config fields hold dataclasses, lists, tuples, dicts, enums, paths and scalars"
    )


def _outside_union(tp: Any, value: Any) -> bool:
    """`value` is a module-level dataclass of a type the union annotation `tp` does not name."""
    if typing.get_origin(tp) not in (typing.Union, types.UnionType):
        return False
    cls = type(value)
    foreign = dataclasses.is_dataclass(value) and cls not in typing.get_args(tp)
    return foreign and "<locals>" not in cls.__qualname__


def _class_name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _imported_class(name: Any, *, path: str) -> type:
    """The dataclass `module:QualName` from a module already imported (nothing is imported
    here: a recipe file's module is, when its run's recipe is loaded)."""
    module_name, _, qualname = name.partition(":") if isinstance(name, str) else ("", "", "")
    target: Any = sys.modules.get(module_name)
    for part in qualname.split(".") if target is not None else ():
        target = getattr(target, part, None)
    if not (isinstance(target, type) and dataclasses.is_dataclass(target)):
        raise ValueError(
            f"field '{path}': saved as {name!r}, a config class that is not loaded; it is "
            "found in the module of the run's recipe ('module:function' or 'file.py:function'), "
            "which loading the run's config.json imports"
        )
    return target


def config_from_dict(cls: type, data: Any) -> Any:
    """Rebuild a `cls` dataclass from `config_to_dict` output; any mismatch is a ValueError."""
    if not (dataclasses.is_dataclass(cls) and isinstance(cls, type)):
        raise TypeError(f"config_from_dict needs a dataclass type, got {cls!r}")
    return _from_json(cls, data, path="")


def _from_json(tp: Any, value: Any, *, path: str) -> Any:
    # A bare `list`/`tuple`/`dict` annotation means the same as one with Any arguments.
    origin = typing.get_origin(tp) or (tp if tp in (list, tuple, dict) else None)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if tp is None or tp is type(None):
        return _expect(value is None, None, tp=tp, value=value, path=path)
    if origin is typing.Union or origin is types.UnionType:
        return _from_union(args, value, tp=tp, path=path)
    if origin is Literal:
        ok = any(type(value) is type(choice) and value == choice for choice in args)
        return _expect(ok, value, tp=tp, value=value, path=path)
    if origin in (list, tuple, dict):
        return _from_container(origin, args, value, tp=tp, path=path)
    if not isinstance(tp, type):
        raise TypeError(f"field '{path}': cannot load annotation {tp!r} from JSON")
    if dataclasses.is_dataclass(tp):
        return _from_dataclass(tp, value, path=path)
    if issubclass(tp, enum.Enum):
        valid = [member.value for member in tp]
        # Compare types too: True == 1 and 1.0 == 1, but neither is the saved value of 1.
        if not any(type(value) is type(choice) and value == choice for choice in valid):
            raise ValueError(
                f"field '{path}': expected one of {valid} ({tp.__qualname__}), got {value!r}"
            )
        return tp(value)
    if issubclass(tp, pathlib.PurePath):
        ok = isinstance(value, str)
        return _expect(ok, tp(value) if ok else None, tp=tp, value=value, path=path)
    if tp is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        return _expect(ok, float(value) if ok else None, tp=tp, value=value, path=path)
    if tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
        return _expect(ok, value, tp=tp, value=value, path=path)
    if tp in (bool, str):
        return _expect(isinstance(value, tp), value, tp=tp, value=value, path=path)
    raise TypeError(f"field '{path}': cannot load type {_type_name(tp)} from JSON")


def _from_dataclass(cls: type, value: Any, *, path: str) -> Any:
    if not isinstance(value, dict):
        raise ValueError(
            f"field '{path or '<root>'}': expected a dict of {cls.__qualname__} fields, "
            f"got {value!r}"
        )
    hints = typing.get_type_hints(cls)
    names = _init_names(cls)
    unknown = [key for key in value if key not in names]
    if unknown:
        renamed = vars(cls).get("renamed_fields", {}).get(unknown[0])
        moved = f" (now '{_join(path, renamed)}': saved before it moved)" if renamed else ""
        raise ValueError(
            f"unknown field '{_join(path, str(unknown[0]))}' for {cls.__qualname__}{moved}; "
            f"valid fields: {', '.join(names)}"
        )
    missing = [name for name in names if name not in value]
    if missing:
        raise ValueError(
            f"missing field '{_join(path, missing[0])}' for {cls.__qualname__}: a saved config "
            "lists every field, so nothing falls back to a default"
        )
    kwargs = {name: _from_json(hints[name], value[name], path=_join(path, name)) for name in names}
    return cls(**kwargs)


def _from_union(members: tuple[Any, ...], value: Any, *, tp: Any, path: str) -> Any:
    if value is None:
        return _expect(type(None) in members, None, tp=tp, value=value, path=path)
    if isinstance(value, dict) and CLASS_KEY in value:
        fields = {key: item for key, item in value.items() if key != CLASS_KEY}
        return _from_dataclass(_imported_class(value[CLASS_KEY], path=path), fields, path=path)
    members = tuple(member for member in members if member is not type(None))
    if len(members) == 1:
        return _from_json(members[0], value, path=path)
    configs = [m for m in members if isinstance(m, type) and dataclasses.is_dataclass(m)]
    if configs and isinstance(value, dict):
        matching = [cls for cls in configs if set(_init_names(cls)) == value.keys()]
        if len(matching) > 1:
            raise ValueError(
                f"field '{path}': saved keys match several types of {_type_name(tp)} "
                f"({', '.join(cls.__qualname__ for cls in matching)}); give them distinct fields"
            )
        if len(matching) == 1:
            return _from_json(matching[0], value, path=path)
    errors = []
    for member in members:
        try:
            return _from_json(member, value, path=path)
        except (TypeError, ValueError) as error:
            errors.append(f"as {_type_name(member)}: {error}")
    raise ValueError(
        f"field '{path}': expected {_type_name(tp)}, got {value!r}; " + "; ".join(errors)
    )


def _from_container(origin: type, args: tuple[Any, ...], value: Any, *, tp: Any, path: str) -> Any:
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"field '{path}': expected {_type_name(tp)}, got {value!r}")
        key_tp, item_tp = args or (str, Any)
        if key_tp is not str:
            raise TypeError(f"field '{path}': only dict[str, ...] can be saved, not {tp!r}")
        return {
            key: _from_json(item_tp, item, path=f"{path}[{key!r}]") for key, item in value.items()
        }
    if not isinstance(value, list):
        raise ValueError(f"field '{path}': expected {_type_name(tp)} as a list, got {value!r}")
    if origin is list or not args or (len(args) == 2 and args[1] is Ellipsis):
        item_tps = [args[0] if args else Any] * len(value)
    else:
        if len(args) != len(value):
            raise ValueError(
                f"field '{path}': expected {_type_name(tp)} with {len(args)} items, got {value!r}"
            )
        item_tps = list(args)
    items = [
        _from_json(item_tp, item, path=f"{path}[{index}]")
        for index, (item_tp, item) in enumerate(zip(item_tps, value, strict=True))
    ]
    return items if origin is list else tuple(items)


def _init_names(cls: type) -> list[str]:
    # init=False fields are derived in __post_init__, so they are neither saved nor loaded.
    return [field.name for field in dataclasses.fields(cls) if field.init]


def _expect(ok: bool, result: Any, *, tp: Any, value: Any, path: str) -> Any:
    if not ok:
        raise ValueError(
            f"field '{path}': expected {_type_name(tp)}, got {value!r} ({type(value).__name__})"
        )
    return result


def _type_name(tp: Any) -> str:
    """Annotation as written in the class body: `Adam.Config | None`, `tuple[int, ...]`."""
    if tp is type(None):
        return "None"
    if tp is Ellipsis:
        return "..."
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union or origin is types.UnionType:
        return " | ".join(_type_name(arg) for arg in args)
    if origin is Literal:
        return f"Literal[{', '.join(repr(arg) for arg in args)}]"
    if origin is not None:
        return f"{_type_name(origin)}[{', '.join(_type_name(arg) for arg in args)}]"
    return tp.__qualname__ if isinstance(tp, type) else str(tp)


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def save_config(path: str | pathlib.Path, config: Any, *, recipe: str | None) -> None:
    """Write `config` (and the recipe it came from) as JSON that `load_config` rebuilds."""
    cls = type(config)
    if "<locals>" in cls.__qualname__:
        raise TypeError(
            f"cannot save {cls.__qualname__}: a config class defined inside a function cannot "
            "be imported again when the run is loaded; define it at module level"
        )
    document = {
        "recipe": recipe,
        "config_class": f"{cls.__module__}:{cls.__qualname__}",
        "config": config_to_dict(config),
    }
    pathlib.Path(path).write_text(json.dumps(document, indent=2) + "\n")


def load_config(path: str | pathlib.Path) -> LoadedConfig:
    """Read a `save_config` file back into the same config object (equal to the saved one)."""
    text = pathlib.Path(path).read_text()
    document = json.loads(text)
    expected_keys = {"recipe", "config_class", "config"}
    if not isinstance(document, dict) or document.keys() != expected_keys:
        keys = sorted(document) if isinstance(document, dict) else type(document).__name__
        raise ValueError(
            f"{path}: expected a JSON object with keys {sorted(expected_keys)}, got {keys}"
        )
    recipe = document["recipe"]
    if recipe is not None and not isinstance(recipe, str):
        raise ValueError(f"{path}: recipe must be a string or null, got {recipe!r}")
    cls = _import_config_class(document["config_class"], recipe=recipe, source=path)
    if recipe is not None and recipes.is_recipe_spec(recipe) and CLASS_KEY in text:
        recipes.get_recipe(recipe)  # imports the recipe's module: its classes are saved by name
    return LoadedConfig(recipe=recipe, config=config_from_dict(cls, document["config"]))


def _import_config_class(name: Any, *, recipe: str | None, source: Any) -> type:
    if not isinstance(name, str) or name.count(":") != 1:
        raise ValueError(f"{source}: config_class must be 'module:QualName', got {name!r}")
    module_name, qualname = name.split(":")
    trusted = module_name.split(".")[0] in TRUSTED_PACKAGES
    if not trusted and recipe is not None and recipes.is_recipe_spec(recipe):
        # Resolving the spec imports (or reuses) the recipe's own module.
        trusted = recipes.get_recipe(recipe).fn.__module__ == module_name
    if not trusted:
        raise ValueError(
            f"{source}: refusing to import config_class {name!r}: config classes load only from "
            f"the packages {list(TRUSTED_PACKAGES)} or the module of a 'module:function' recipe"
        )
    target: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        target = getattr(target, part, None)
    if not (isinstance(target, type) and dataclasses.is_dataclass(target)):
        raise ValueError(f"{source}: config_class {name!r} is not a dataclass in {module_name}")
    return target
