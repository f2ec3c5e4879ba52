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


@pytest.mark.vllm
def test_a_base_model_the_vllm_backend_cannot_run_is_refused_before_listening(tmp_path, capsys):
    """vLLM's CPU build and a hybrid Qwen3.5 (generator/vllm_hybrid.py): refused at startup
    with the generator's reasons, not by the first create_lora_training_client."""
    import socket

    import torch

    pytest.importorskip("vllm", reason="the vllm extra is not installed (make vllm)")
    if torch.cuda.is_available():
        pytest.skip("vLLM's CUDA build runs Qwen3.5")
    from temper.checkpoint.model_source import init_model_dir

    model_dir = tmp_path / "qwen3_5"
    init_model_dir(model_dir, family="qwen3_5", size="tiny", tokenizer="digits", seed=0)
    with socket.socket() as probe:  # a port free now; the refusal must come before binding it
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    argv = ["serve", "--model", str(model_dir), "--port", str(port)]
    assert main([*argv, "--generator.backend", "vllm", "--storage", str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err
    assert f"model directory {model_dir}" in err and "vLLM's CPU build" in err
    assert "bfloat16 only, not float32" in err and "linear_key_head_dim=32" in err
    assert "--generator.backend temper" in err
    with socket.socket() as again:  # nothing holds the port
        again.bind(("127.0.0.1", port))
