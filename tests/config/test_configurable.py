"""Behaviour of the Configurable base: build(), runtime objects vs settings, owner mapping."""

from __future__ import annotations

import dataclasses

import pytest

from temper.config import Configurable


class Layer(Configurable):
    @dataclasses.dataclass(kw_only=True)
    class Config(Configurable.Config):
        width: int = 4
        """Width of the layer."""

    def __init__(self, config: Config, *, scale: float = 1.0) -> None:
        self.config = config
        self.scale = scale


class Stack(Configurable):
    @dataclasses.dataclass(kw_only=True)
    class Config(Configurable.Config):
        layer: Layer.Config = dataclasses.field(default_factory=Layer.Config)
        """Settings of every layer."""
        num_layers: int = 2
        """Layers in the stack."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.layers = [config.layer.build(scale=0.5) for _ in range(config.num_layers)]


class WideLayer(Layer):
    """Reuses Layer's Config without declaring its own."""


def test_build_passes_config_and_runtime_objects() -> None:
    layer = Layer.Config(width=8).build(scale=2.0)
    assert isinstance(layer, Layer)
    assert layer.config == Layer.Config(width=8)
    assert layer.scale == 2.0


def test_build_rejects_settings_as_keyword_arguments() -> None:
    with pytest.raises(TypeError, match=r"\['width'\]"):
        Layer.Config().build(width=16)


def test_nested_configs_build_their_own_owner() -> None:
    stack = Stack.Config(layer=Layer.Config(width=3), num_layers=3).build()
    assert isinstance(stack, Stack)
    assert [type(layer) for layer in stack.layers] == [Layer] * 3
    assert all(layer.config.width == 3 and layer.scale == 0.5 for layer in stack.layers)
    assert Stack.Config._owner is Stack
    assert Layer.Config._owner is Layer


def test_subclass_without_config_keeps_building_parent() -> None:
    assert WideLayer.Config is Layer.Config
    assert type(WideLayer.Config().build()) is Layer


def test_config_not_nested_in_a_component_cannot_build() -> None:
    @dataclasses.dataclass(kw_only=True)
    class Loose(Configurable.Config):
        size: int = 1

    with pytest.raises(TypeError, match="not nested"):
        Loose().build()


def test_config_must_subclass_base_config() -> None:
    with pytest.raises(TypeError, match=r"Config must subclass Configurable.Config"):

        class Broken(Configurable):
            @dataclasses.dataclass
            class Config:
                size: int = 1


def test_config_must_be_decorated_as_dataclass() -> None:
    # Without the decorator the annotated setting would silently not be a field.
    with pytest.raises(TypeError, match="dataclass"):

        class Undecorated(Configurable):
            class Config(Configurable.Config):
                size: int = 1


def test_missing_packages_are_named_by_flag_before_a_run_starts(tmp_path, monkeypatch, capsys):
    import importlib.util

    from temper.cli import main
    from temper.config.configurable import missing_packages
    from temper.rl.job import RLJob

    absent = {"vllm", "tensorboard"}
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name in absent else find_spec(name, *a),
    )
    config = RLJob.Config()
    assert missing_packages(config) == []  # the defaults need nothing optional
    config.generator.backend = "vllm"
    config.metrics.tensorboard = True
    lines = missing_packages(config)
    assert any(line.startswith("--generator.backend 'vllm' needs vLLM") for line in lines)
    assert any(
        line.startswith("--metrics.tensorboard True needs the tensorboard") for line in lines
    )
    run_dir = tmp_path / "run"
    argv = ["train", "sum_digits_smoke", "--run-dir", str(run_dir), "--metrics.tensorboard", "True"]
    assert main(argv) == 2
    assert "--metrics.tensorboard True needs the tensorboard package" in capsys.readouterr().err
    assert not run_dir.exists()  # refused before the run directory is made
