"""Named recipes: functions that return a root config, found by scanning the `recipes` package.

There is no registry dict. `@recipe("...")` only marks a function; `list_recipes` imports every
module of the package (pkgutil) and collects the marked functions each time it is asked, so
importing a module never changes global state. A recipe outside the package is named by a spec,
"some.module:function" or "path/to/file.py:function"; the function need not be marked.

A variant recipe may import a base recipe from another module; a function counts only in the
module that defines it, so it is not listed twice.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import importlib
import importlib.util
import inspect
import pathlib
import pkgutil
import re
import sys
import types
from collections.abc import Callable
from typing import Any, TypeVar

RECIPES_PACKAGE = "recipes"
"""Top-level package scanned for `@recipe` functions."""

_MARK = "__temper_recipe__"

RecipeFn = TypeVar("RecipeFn", bound=Callable[[], Any])


@dataclasses.dataclass(frozen=True)
class RecipeInfo:
    """A recipe: its name, one-line description and the function that returns its config."""

    name: str
    description: str
    fn: Callable[[], Any]
    default: bool = False


@dataclasses.dataclass(frozen=True)
class _Mark:
    name: str | None
    description: str
    default: bool


def recipe(
    description: str, *, name: str | None = None, default: bool = False
) -> Callable[[RecipeFn], RecipeFn]:
    """Mark a function returning a root config as a recipe (named `name` or the function name).

    `default=True` makes it the recipe `temper train` runs when none is named; at most one recipe
    in the package may be the default.
    """
    if not isinstance(description, str):
        raise TypeError("use @recipe('one-line description'), with the description as argument")
    if not description.strip() or "\n" in description:
        raise ValueError(f"recipe description must be one non-empty line, got {description!r}")
    if name is not None and (not name or ":" in name):
        raise ValueError(f"recipe name must be non-empty without ':', got {name!r}")

    def mark(fn: RecipeFn) -> RecipeFn:
        setattr(fn, _MARK, _Mark(name=name, description=description.strip(), default=default))
        return fn

    return mark


def list_recipes(*, package: str = RECIPES_PACKAGE) -> list[RecipeInfo]:
    """All `@recipe` functions in the modules of `package`, sorted by name."""
    found: dict[str, RecipeInfo] = {}
    for module in _package_modules(package):
        for fn in vars(module).values():
            if getattr(fn, "__module__", None) != module.__name__ or not hasattr(fn, _MARK):
                continue
            info = _info(fn)
            if info.name in found:
                raise ValueError(
                    f"recipe name {info.name!r} is used by both {_where(found[info.name].fn)} "
                    f"and {_where(fn)}; pass name= to @recipe to tell them apart"
                )
            found[info.name] = info
    defaults = [info for info in found.values() if info.default]
    if len(defaults) > 1:
        raise ValueError(
            "only one recipe may be default=True, found "
            + ", ".join(f"{info.name!r} ({_where(info.fn)})" for info in defaults)
        )
    return sorted(found.values(), key=lambda info: info.name)


def get_recipe(name: str, *, package: str = RECIPES_PACKAGE) -> RecipeInfo:
    """The recipe called `name` in `package`, or the function named by a "module:function" spec."""
    if is_recipe_spec(name):
        return _load_spec(name)
    known = list_recipes(package=package)
    for info in known:
        if info.name == name:
            return info
    names = [info.name for info in known]
    close = difflib.get_close_matches(name, names, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise ValueError(
        f"unknown recipe {name!r}; {hint}known recipes: {', '.join(names) or '(none)'} "
        "(a recipe outside the package is given as module:function or path/to/file.py:function)"
    )


def default_recipe(*, package: str = RECIPES_PACKAGE) -> RecipeInfo:
    """The recipe marked `default=True` in `package`."""
    known = list_recipes(package=package)
    for info in known:
        if info.default:
            return info
    raise ValueError(
        "no recipe is marked @recipe(..., default=True); name one of: "
        + (", ".join(info.name for info in known) or "(none)")
    )


def is_recipe_spec(name: str) -> bool:
    """Whether `name` is a "module:function" or "file.py:function" spec rather than a name."""
    return ":" in name


def _info(fn: Callable[[], Any]) -> RecipeInfo:
    mark: _Mark = getattr(fn, _MARK)
    return RecipeInfo(
        name=mark.name or fn.__name__, description=mark.description, fn=fn, default=mark.default
    )


def _where(fn: Callable[..., Any]) -> str:
    return f"{fn.__module__}.{fn.__qualname__}"


def _package_modules(package: str) -> list[types.ModuleType]:
    root = importlib.import_module(package)
    modules = [root]
    # walk_packages imports subpackages to look inside them; plain modules we import here.
    for module_info in pkgutil.walk_packages(root.__path__, prefix=f"{package}."):
        modules.append(importlib.import_module(module_info.name))
    return modules


def _load_spec(spec: str) -> RecipeInfo:
    location, _, fn_name = spec.rpartition(":")
    if location.endswith(".py") or "/" in location or "\\" in location:
        path = pathlib.Path(location).resolve()
        module = _import_file(path, spec=spec)
        name = f"{path}:{fn_name}"  # absolute, so a saved run resolves from any directory
    else:
        module = _import_module(location, spec=spec)
        name = spec
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        # Named as the user wrote it (a file is imported under a private module name), with
        # the functions defined there: any of them that returns a config is a recipe.
        defined = [
            name
            for name, value in vars(module).items()
            if inspect.isfunction(value)
            and value.__module__ == module.__name__
            and not name.startswith("_")
        ]
        raise ValueError(
            f"recipe spec {spec!r}: {location} has no function {fn_name!r}"
            + (f"; its functions: {', '.join(defined)}" if defined else "")
        )
    if hasattr(fn, _MARK):
        return dataclasses.replace(_info(fn), name=name)
    doc = inspect.getdoc(fn) or ""
    return RecipeInfo(name=name, description=doc.split("\n", 1)[0], fn=fn)


def _import_module(module_name: str, *, spec: str) -> types.ModuleType:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        # Only the spec's own module being absent is a bad spec; a missing import inside it is a
        # real error in the user's code and keeps its traceback.
        if error.name is None or not (module_name + ".").startswith(error.name + "."):
            raise
        raise ValueError(f"recipe spec {spec!r}: no module named {module_name!r}") from None


def _import_file(path: pathlib.Path, *, spec: str) -> types.ModuleType:
    if not path.is_file():
        raise ValueError(f"recipe spec {spec!r}: no file {path}")
    # One module per file path, kept in sys.modules: classes must stay identical between the
    # recipe and a config loaded back from disk, and dataclasses look modules up there.
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
    stem = re.sub(r"\W", "_", path.stem)
    module_name = f"temper_recipe_file_{stem}_{digest}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module
