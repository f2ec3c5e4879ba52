"""JSON round trips of configs, and the strictness that makes a saved run reproduce exactly."""

from __future__ import annotations

import dataclasses
import enum
import json
import pathlib
from typing import Literal

import pytest

from temper.config import (
    Configurable,
    config_from_dict,
    config_to_dict,
    load_config,
    save_config,
)


class Precision(enum.StrEnum):
    FP32 = "fp32"
    BF16 = "bf16"


class Color(enum.Enum):
    RED = 1
    BLUE = 2


class Adam(Configurable):
    @dataclasses.dataclass(kw_only=True)
    class Config(Configurable.Config):
        learning_rate: float = 1e-3
        """Step size."""
        betas: tuple[float, float] = (0.9, 0.999)
        """Moment decay rates."""


class Sgd(Configurable):
    @dataclasses.dataclass(kw_only=True)
    class Config(Configurable.Config):
        learning_rate: float = 0.1
        """Step size."""
        momentum: float = 0.0
        """Momentum factor."""


class Model(Configurable):
    @dataclasses.dataclass(kw_only=True)
    class Config(Configurable.Config):
        width: int = 8
        """Hidden width."""
        norm: Literal["rms", "layer"] = "rms"
        """Normalization layer."""


class Run(Configurable):
    @dataclasses.dataclass(kw_only=True)
    class Config(Configurable.Config):
        model: Model.Config = dataclasses.field(default_factory=Model.Config)
        """Model settings."""
        optimizer: Adam.Config | Sgd.Config = dataclasses.field(default_factory=Adam.Config)
        """Optimizer settings."""
        teacher: Model.Config | None = None
        """Optional teacher model."""
        shape: tuple[int, ...] = (2, 3)
        """Any number of ints."""
        seeds: list[int] = dataclasses.field(default_factory=lambda: [1, 2])
        """Seeds to run."""
        weights: dict[str, float] = dataclasses.field(default_factory=dict)
        """Per-task weights."""
        precision: Precision = Precision.FP32
        """Training precision."""
        color: Color = Color.RED
        """A plain Enum."""
        checkpoint: pathlib.Path | None = None
        """Where to start from."""
        name: str = "run"
        """Run name."""
        verbose: bool = False
        """Log more."""

    def __init__(self, config: Config) -> None:
        self.config = config


def run_recipe() -> Run.Config:
    return Run.Config()


RECIPE_SPEC = f"{__name__}:run_recipe"


def full_config() -> Run.Config:
    return Run.Config(
        model=Model.Config(width=16, norm="layer"),
        optimizer=Sgd.Config(learning_rate=0.5, momentum=0.9),
        teacher=Model.Config(width=32),
        shape=(4, 5, 6),
        seeds=[7],
        weights={"math": 0.5, "code": 2.0},
        precision=Precision.BF16,
        color=Color.BLUE,
        checkpoint=pathlib.Path("/ckpt/step-10"),
        name="full",
        verbose=True,
    )


@pytest.mark.parametrize("config", [Run.Config(), full_config()], ids=["defaults", "full"])
def test_round_trip_through_json_text(config: Run.Config) -> None:
    data = json.loads(json.dumps(config_to_dict(config)))
    assert config_from_dict(Run.Config, data) == config


def test_to_dict_writes_plain_json_types_in_declaration_order() -> None:
    data = config_to_dict(full_config())
    assert list(data) == [field.name for field in dataclasses.fields(Run.Config)]
    assert data["model"] == {"width": 16, "norm": "layer"}
    assert data["shape"] == [4, 5, 6]
    assert data["precision"] == "bf16"
    assert data["color"] == 2
    assert data["checkpoint"] == "/ckpt/step-10"
    assert config_to_dict(Run.Config())["teacher"] is None


def test_unknown_key_names_dotted_path_and_valid_fields() -> None:
    data = config_to_dict(Run.Config())
    data["model"]["widht"] = 3
    with pytest.raises(ValueError, match=r"'model\.widht'.*valid fields: width, norm"):
        config_from_dict(Run.Config, data)


def test_missing_key_names_dotted_path() -> None:
    data = config_to_dict(Run.Config())
    del data["model"]["norm"]
    with pytest.raises(ValueError, match=r"missing field 'model\.norm'"):
        config_from_dict(Run.Config, data)


def test_missing_key_in_union_of_configs_reports_each_member() -> None:
    data = config_to_dict(Run.Config())
    del data["optimizer"]["betas"]
    with pytest.raises(ValueError, match=r"missing field 'optimizer\.betas'") as error:
        config_from_dict(Run.Config, data)
    assert "missing field 'optimizer.momentum'" in str(error.value)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("name", 3, r"'name': expected str, got 3"),
        ("verbose", 1, r"'verbose': expected bool, got 1"),
        ("seeds", [1, True], r"'seeds\[1\]': expected int, got True"),
        ("seeds", [1.5], r"'seeds\[0\]': expected int, got 1.5"),
        ("shape", [4, "5"], r"'shape\[1\]': expected int, got '5'"),
        ("precision", "fp8", r"'precision': expected one of \['fp32', 'bf16'\]"),
        ("color", True, r"'color': expected one of \[1, 2\] \(Color\), got True"),
        ("checkpoint", 5, r"'checkpoint': expected Path, got 5"),
        ("weights", {"math": "high"}, r"'weights\['math'\]': expected float, got 'high'"),
    ],
)
def test_wrong_type_names_path_expected_type_and_value(
    field: str, value: object, message: str
) -> None:
    data = config_to_dict(Run.Config())
    data[field] = value
    with pytest.raises(ValueError, match=message):
        config_from_dict(Run.Config, data)


def test_nested_wrong_type_and_literal() -> None:
    data = config_to_dict(Run.Config())
    data["model"]["norm"] = "batch"
    with pytest.raises(ValueError, match=r"'model\.norm': expected Literal\['rms', 'layer'\]"):
        config_from_dict(Run.Config, data)


def test_int_is_accepted_for_float_and_becomes_float() -> None:
    data = config_to_dict(Run.Config())
    data["optimizer"]["learning_rate"] = 1
    loaded = config_from_dict(Run.Config, data)
    assert loaded.optimizer.learning_rate == 1.0
    assert type(loaded.optimizer.learning_rate) is float


def test_fixed_length_tuple_checks_length() -> None:
    data = config_to_dict(Run.Config())
    data["optimizer"]["betas"] = [0.9]
    with pytest.raises(ValueError, match=r"'optimizer\.betas': expected tuple\[float, float\]"):
        config_from_dict(Run.Config, data)


@dataclasses.dataclass
class Left:
    size: int = 1


@dataclasses.dataclass
class Right:
    size: int = 2


@dataclasses.dataclass
class Holder:
    side: Left | Right


def test_union_of_configs_with_same_fields_is_ambiguous() -> None:
    with pytest.raises(ValueError, match=r"'side'.*several types"):
        config_from_dict(Holder, {"side": {"size": 3}})


def test_save_and_load_config_file(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "config.json"
    save_config(path, full_config(), recipe=RECIPE_SPEC)
    document = json.loads(path.read_text())
    assert list(document) == ["recipe", "config_class", "config"]
    assert document["config_class"] == f"{__name__}:Run.Config"
    loaded = load_config(path)
    assert loaded.recipe == RECIPE_SPEC
    assert loaded.config == full_config()


def test_load_refuses_config_class_outside_trusted_modules(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "config.json"
    # A plain recipe name does not vouch for this test module; only a module:function spec does.
    save_config(path, Run.Config(), recipe="some_name")
    with pytest.raises(ValueError, match="refusing to import config_class"):
        load_config(path)
    path.write_text(json.dumps({"recipe": None, "config_class": "os:PathLike", "config": {}}))
    with pytest.raises(ValueError, match="refusing to import config_class 'os:PathLike'"):
        load_config(path)


def test_load_rejects_malformed_document(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "config.json"
    save_config(path, Run.Config(), recipe=RECIPE_SPEC)
    document = json.loads(path.read_text())
    document["extra"] = 1
    path.write_text(json.dumps(document))
    with pytest.raises(ValueError, match="expected a JSON object with keys"):
        load_config(path)


def test_save_refuses_function_local_class(tmp_path: pathlib.Path) -> None:
    @dataclasses.dataclass
    class Local:
        size: int = 1

    with pytest.raises(TypeError, match="inside a function"):
        save_config(tmp_path / "config.json", Local(), recipe=None)


def test_to_dict_rejects_values_json_cannot_hold() -> None:
    config = Run.Config(weights={"math": object()})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match=r"field 'weights\['math'\]'"):
        config_to_dict(config)
