"""`temper serve --help`: flags from TemperServer.Config, named as `temper train` names them."""

from __future__ import annotations

import pytest

from temper.cli import main

pytest.importorskip("fastapi")


def test_serve_help_flows_docstrings_and_names_the_sharding_subcommand(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["serve", "--help"]) == 0
    out = capsys.readouterr().out
    # compute_threads' docstring has a source line break after "None: one"; the help text
    # flows on past it instead of breaking the sentence there.
    assert any("None: one fewer" in line for line in out.splitlines())
    # Union members are named after their owner class, as in `temper train`.
    assert "trainer.sharding:sharding" in out
    assert "trainer.sharding:config" not in out
