"""`temper serve --help`: flags from TemperServer.Config, named as `temper train` names them."""

from __future__ import annotations

import sys

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


def test_a_port_in_use_is_refused_before_any_model_loads(tmp_path, capsys):
    import socket

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        # The model directory does not exist: the port is checked first.
        argv = ["serve", "--model", str(tmp_path / "absent"), "--port", str(port)]
        assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on --host 127.0.0.1 --port {port}" in err
    assert "choose another --port" in err and "absent" not in err


def test_without_the_server_extra_the_hint_installs_it_into_this_interpreter(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # as if the extra were not installed
    assert main(["serve", "--help"]) == 2
    err = capsys.readouterr().err
    # Not `pip install temper[server]`: the `temper` on PyPI is another project.
    assert f"{sys.executable} -m pip install -e '.[server]'" in err
