"""`temper sample` through the real entry point, on a tiny random model with the letters vocabulary.

Greedy output is checked against the oracle decoder, so the command is known to print
what the model generates, not just something shaped like it.
"""

from __future__ import annotations

import pytest

from temper import AdamParams, Datum, ModelInput, SamplingParams, ServiceClient
from temper.checkpoint.hf import load_pretrained
from temper.checkpoint.model_source import init_model_dir
from temper.cli import main
from temper.sampler.oracle import greedy_decode
from temper.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("sample") / "m"
    init_model_dir(path, tokenizer="letters", seed=3)
    return path


def _completions(output: str) -> list[str]:
    """The text under each completion's title line (output without --logprobs)."""
    chunks = output.split("\ncompletion ")[1:]
    return [chunk.split("\n", 1)[1].removesuffix("\n") for chunk in chunks]


def _greedy_text(model_dir, prompt: str, *, max_tokens: int) -> str:
    tokenizer = load_tokenizer(model_dir)
    (tokens,) = greedy_decode(
        load_pretrained(model_dir),
        [tokenizer.encode(prompt)],
        max_new_tokens=max_tokens,
        stop_token_ids=[tokenizer.eos_token_id],
    )
    return tokenizer.decode(tokens)


def test_prints_each_completion_with_its_stop_reason(model_dir, capsys):
    argv = ["sample", "--model", str(model_dir), "--prompt", "Hi", "-n", "3", "--max-tokens", "6"]
    assert main([*argv, "--seed", "7"]) == 0
    output = capsys.readouterr().out
    assert 'prompt: "Hi" (2 tokens); 3 completions' in output
    titles = [line for line in output.splitlines() if line.startswith("completion ")]
    assert [title.split(":")[0] for title in titles] == [f"completion {i}" for i in range(3)]
    assert all("stop reason" in title and "sum of logprobs" in title for title in titles)
    assert main([*argv, "--seed", "7"]) == 0
    assert _completions(capsys.readouterr().out) == _completions(output)


def test_greedy_matches_the_reference_decoder(model_dir, capsys):
    argv = ["sample", "--model", str(model_dir), "--prompt", "abc", "--temperature", "0"]
    assert main([*argv, "-n", "2", "--max-tokens", "8"]) == 0
    expected = _greedy_text(model_dir, "abc", max_tokens=8)
    assert _completions(capsys.readouterr().out) == [expected, expected]
    # Without -n, greedy prints one completion (they would all be alike), sampling four.
    assert main([*argv, "--max-tokens", "8"]) == 0
    assert _completions(capsys.readouterr().out) == [expected]


def test_chat_samples_a_reply_to_the_prompt_in_that_format(model_dir, capsys):
    argv = ["sample", "--model", str(model_dir), "--prompt", "Hi", "--temperature", "0"]
    assert main([*argv, "-n", "1", "--max-tokens", "8", "--chat", "role_colon"]) == 0
    output = capsys.readouterr().out
    assert "User: Hi" in output and "Assistant:" in output.split(" tokens);")[0]
    # The random model never writes the format's stop ("\n\nUser:") in 8 tokens.
    assert _completions(output) == [_greedy_text(model_dir, "User: Hi\n\nAssistant:", max_tokens=8)]
    # A format that stops at token ids takes no --stop strings.
    assert main([*argv, "--chat", "qwen3_no_think", "--stop", "x"]) == 2
    assert "--stop takes strings, but --chat's format stops at token ids" in capsys.readouterr().err


def test_stop_string_ends_the_completion(model_dir, capsys):
    greedy = _greedy_text(model_dir, "abc", max_tokens=8)
    stop = greedy[2:4]
    argv = ["sample", "--model", str(model_dir), "--prompt", "abc", "--temperature", "0"]
    assert main([*argv, "-n", "1", "--max-tokens", "8", "--stop", "~never~", stop]) == 0
    output = capsys.readouterr().out
    (completion,) = _completions(output)
    assert completion.endswith(stop) and greedy.startswith(completion)
    assert f"stop reason stop, {len(completion)} tokens" in output


def test_logprobs_table(model_dir, capsys):
    argv = ["sample", "--model", str(model_dir), "--prompt", "Hi", "-n", "1", "--max-tokens", "4"]
    assert main([*argv, "--logprobs", "--seed", "1"]) == 0
    output = capsys.readouterr().out
    assert "logprob" in output and "top 3 (logprob)" in output
    rows = [line for line in output.splitlines() if line.startswith("\u2502")]
    assert len(rows) == int(output.split(" tokens, sum of logprobs")[0].rsplit(" ", 1)[1])


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--temperature", "-1"], "--temperature must be a finite number >= 0"),
        (["--top-p", "0"], "--top-p must be in (0, 1]"),
        (["--top-k", "-3"], "--top-k must be an int >= 1"),
        (["--max-tokens", "0"], "--max-tokens must be > 0"),
        (["-n", "0"], "-n must be >= 1"),
        (["--prompt", ""], "encodes to zero tokens"),
        (["--prompt", "caf\u00e9"], "cannot encode the text"),
        (
            ["--prompt", "a" * 2048],
            "--prompt has 2048 tokens; the model holds at most 2048 tokens (prompt + completion), "
            "so a prompt may have at most 2047",
        ),
    ],
)
def test_bad_input_is_a_clean_error(model_dir, capsys, flags, message):
    assert main(["sample", "--model", str(model_dir), "--prompt", "Hi", *flags]) == 2
    error = capsys.readouterr().err
    assert error.startswith("temper sample: error: ") and message in error


def test_prompt_text_outside_the_vocabulary_is_named(tmp_path, capsys):
    path = tmp_path / "words"
    init_model_dir(path, tokenizer="words", seed=3)
    argv = ["sample", "--model", str(path), "--prompt", "the zebra run", "-n", "1"]
    assert main([*argv, "--max-tokens", "2"]) == 0
    note = "encodes as its unknown token (pieces not in the vocabulary: ['zebra'])"
    assert note in capsys.readouterr().err


def test_missing_model_dir_is_a_clean_error(tmp_path, capsys):
    assert main(["sample", "--model", str(tmp_path / "nope"), "--prompt", "Hi"]) == 2
    assert "temper sample: error: --model" in capsys.readouterr().err


def test_sample_is_listed(capsys):
    assert main(["--help"]) == 0
    assert "sample" in capsys.readouterr().out


def test_samples_from_a_runs_lora_sampler_weights(tmp_path, capsys):
    service = ServiceClient(storage_dir=tmp_path / "checkpoints")
    training = service.create_lora_training_client("tiny", rank=4)
    tokenizer = training.get_tokenizer()
    tokens = tokenizer.encode("12=3")
    weights = [1.0] * (len(tokens) - 1)
    datum = Datum(
        model_input=ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights},
    )
    training.forward_backward([datum], "cross_entropy").result()
    training.optim_step(AdamParams(learning_rate=1e-2)).result()
    path = training.save_weights_for_sampler("final").result().path
    _, directory = service.storage.existing(path)
    assert (directory / "lora.safetensors").is_file()  # adapters, not a HF model directory
    params = SamplingParams(max_tokens=6, temperature=0)
    prompt = ModelInput.from_ints(tokenizer.encode("12="))
    response = service.create_sampling_client(model_path=path).sample(prompt, 1, params).result()
    argv = ["sample", "--model", str(directory), "--prompt", "12=", "-n", "1"]
    assert main([*argv, "--max-tokens", "6", "--temperature", "0"]) == 0
    expected = tokenizer.decode(response.sequences[0].tokens)
    assert _completions(capsys.readouterr().out) == [expected]


def test_a_run_directory_stands_for_its_newest_final_weights(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text("{}")
    service = ServiceClient(storage_dir=run_dir / "checkpoints")
    first = service.create_training_client("tiny")
    first.save_weights_for_sampler("final").result()
    resumed = service.create_training_client("tiny")  # a resumed run's process: a new run id
    tokenizer = resumed.get_tokenizer()
    tokens = tokenizer.encode("12=3")
    datum = Datum(
        model_input=ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )
    resumed.forward_backward([datum], "cross_entropy").result()
    resumed.optim_step(AdamParams(learning_rate=1e-2)).result()
    _, newest = service.storage.existing(resumed.save_weights_for_sampler("final").result().path)
    argv = ["sample", "--prompt", "12=", "-n", "1", "--max-tokens", "6", "--temperature", "0"]
    assert main([*argv, "--model", str(run_dir)]) == 0
    out, err = capsys.readouterr()
    assert f"model: {newest}" in err
    assert main([*argv, "--model", str(newest)]) == 0
    assert _completions(capsys.readouterr().out) == _completions(out)


def test_a_tinker_path_is_refused_with_what_to_give_instead(capsys):
    argv = ["sample", "--model", "tinker://run-1/sampler_weights/final", "--prompt", "1="]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "a tinker:// path names a checkpoint inside a storage directory" in err
    assert "temper sample --model RUN_DIR" in err


def test_chat_stop_joins_the_stop_strings():
    from temper.commands.sample import _with_chat_stop

    assert _with_chat_stop(("###",), ["\n\nUser:"]) == ["###", "\n\nUser:"]
    assert _with_chat_stop((), [2]) == [2]
