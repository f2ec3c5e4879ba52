"""Recipe discovery: marked functions in a package, specs for recipes outside it, errors."""

from __future__ import annotations

import pathlib
import sys
import textwrap
import uuid
from collections.abc import Callable, Iterator

import pytest

from temper.config import default_recipe, get_recipe, list_recipes, recipe

WritePackage = Callable[[dict[str, str]], str]


@pytest.fixture
def write_package(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[WritePackage]:
    """Writes {relative path: source} as a fresh uniquely named package; returns its name."""
    monkeypatch.syspath_prepend(str(tmp_path))
    names: list[str] = []

    def write(files: dict[str, str]) -> str:
        name = f"recipes_{uuid.uuid4().hex[:8]}"
        names.append(name)
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("")
        for relative, source in files.items():
            path = tmp_path / name / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(textwrap.dedent(source))
        return name

    yield write
    for module in [m for m in sys.modules if m.split(".")[0] in names]:
        del sys.modules[module]


BASE = """
from temper.config import recipe

@recipe("Small base run.")
def small():
    return {"size": 1}

@recipe("Larger run.", name="large", default=True)
def make_large():
    return {"size": 8}

def helper():
    return "not a recipe"
"""

VARIANT = """
from temper.config import recipe
from ..base import small  # imported, so it must not be listed twice

@recipe("Small run with more steps.")
def small_long():
    config = small()
    config["steps"] = 100
    return config
"""


def test_decorator_only_marks_the_function() -> None:
    def run() -> int:
        return 3

    marked = recipe("A run.")(run)
    assert marked is run
    assert run() == 3


def test_list_recipes_finds_marked_functions_in_all_modules(write_package: WritePackage) -> None:
    package = write_package({"base.py": BASE, "sub/__init__.py": "", "sub/variants.py": VARIANT})
    infos = list_recipes(package=package)
    assert [(info.name, info.description, info.default) for info in infos] == [
        ("large", "Larger run.", True),
        ("small", "Small base run.", False),
        ("small_long", "Small run with more steps.", False),
    ]
    assert get_recipe("small_long", package=package).fn() == {"size": 1, "steps": 100}
    assert default_recipe(package=package).name == "large"


def test_duplicate_names_name_both_functions(write_package: WritePackage) -> None:
    duplicate = 'from temper.config import recipe\n\n@recipe("Other.")\ndef small():\n    pass\n'
    package = write_package({"base.py": BASE, "other.py": duplicate})
    with pytest.raises(ValueError, match=r"'small'.*base\.small.*other\.small"):
        list_recipes(package=package)


def test_only_one_default(write_package: WritePackage) -> None:
    second = 'from temper.config import recipe\n\n@recipe("B.", default=True)\ndef b():\n    pass\n'
    package = write_package({"base.py": BASE, "second.py": second})
    with pytest.raises(ValueError, match=r"only one recipe may be default") as error:
        list_recipes(package=package)
    assert f"'b' ({package}.second.b)" in str(error.value)
    assert f"'large' ({package}.base.make_large)" in str(error.value)


def test_no_default_recipe_lists_names(write_package: WritePackage) -> None:
    package = write_package({"base.py": BASE.replace("default=True", "default=False")})
    with pytest.raises(ValueError, match=r"default=True.*large, small"):
        default_recipe(package=package)


def test_unknown_name_suggests_close_match_and_lists_known(write_package: WritePackage) -> None:
    package = write_package({"base.py": BASE})
    with pytest.raises(ValueError, match=r"'smal'; did you mean 'small'\? known recipes: large"):
        get_recipe("smal", package=package)


def test_module_function_spec(write_package: WritePackage) -> None:
    package = write_package({"base.py": BASE})
    info = get_recipe(f"{package}.base:make_large")
    assert (info.name, info.description, info.fn()) == (
        f"{package}.base:make_large",
        "Larger run.",
        {"size": 8},
    )
    # Unmarked functions are fine in a spec; the docstring's first line describes them.
    assert get_recipe(f"{package}.base:helper").fn() == "not a recipe"


def test_file_spec_imports_once_and_records_absolute_path(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "my_recipes.py"
    path.write_text('def mine():\n    """My own run.\n\n    Details."""\n    return 42\n')
    monkeypatch.chdir(tmp_path)
    info = get_recipe("my_recipes.py:mine")
    assert (info.name, info.description, info.fn()) == (f"{path}:mine", "My own run.", 42)
    assert get_recipe(f"{path}:mine").fn is info.fn
    # A missing function: the file as written and the functions it defines, recipes or not.
    with pytest.raises(
        ValueError, match=r"my_recipes\.py has no function 'nope'; its functions: mine$"
    ):
        get_recipe("my_recipes.py:nope")
    del sys.modules[info.fn.__module__]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_such_module_xyz:run", "no module named 'no_such_module_xyz'"),
        ("missing/file.py:run", "no file"),
        ("pathlib:no_such_function", "no function 'no_such_function'"),
    ],
)
def test_bad_specs(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        get_recipe(spec)


def test_decorator_rejects_bad_arguments() -> None:
    with pytest.raises(TypeError, match="description"):
        recipe(lambda: None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="one non-empty line"):
        recipe("two\nlines")
    with pytest.raises(ValueError, match="without ':'"):
        recipe("Fine.", name="a:b")
