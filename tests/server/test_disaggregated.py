"""`temper serve --nproc 3 --placement.mode disaggregated --placement.generator_ranks 2`.

One trainer rank (under torchrun) and two generator ranks (processes of their own), driven
by the unmodified tinker SDK: training, snapshots, sampling with prompt and top-k logprobs,
compute_logprobs, a base-model sampler and stable_reinforce on recorded sequences give the
one-process server's numbers (the same tokens; logprobs to rounding: the trainer shards with
FSDP on its one rank). In-flight clients sample a target the generator ranks hold, which
each in-flight save moves on mid-sample. Then a generator rank is killed under load: no call
hangs, healthz answers and reports it, the other user's calls keep working, and a snapshot
only the dead rank held is served again, bitwise, by the survivor. The server also serves a
second trainable model and a sample-only one: each trains and samples on the generator ranks
as on the one-process server with the same models.
"""

from __future__ import annotations

import json
import os
import signal
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from tinker import types

from tests.server.conftest import ServerProcess, start_server
from tests.server.test_inflight import (
    a_long_sample_spans_a_save,
    every_client_samples_the_newest_save,
)
from tests.server.test_multimodel import write_model
from tests.server.test_replicated import _assert_close, _train
from tests.server.test_stable_reinforce import rl_datum

DISAGGREGATED = ("--nproc", "3", "--placement.mode", "disaggregated")
PARAMS = types.SamplingParams(max_tokens=4, temperature=1.0, seed=3, stop=[])


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("models") / "teacher-digits"
    return write_model(directory, dim=64, num_layers=2, ffn_dim=128, seed=1)


@pytest.fixture(scope="module")
def grader_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("models") / "grader-digits"
    return write_model(directory, dim=96, num_layers=1, ffn_dim=96, seed=2)


@pytest.fixture(scope="module")
def servers(
    model_dir: Path, teacher_dir: Path, grader_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """(the disaggregated server, a one-process one) on the same three models, started
    together."""
    root = tmp_path_factory.mktemp("disaggregated")
    models = ("--model", str(teacher_dir), "--sample-only-model", str(grader_dir))
    placement = (*DISAGGREGATED, "--placement.generator_ranks", "2")

    def start(name: str, *extra: str) -> ServerProcess:
        return start_server(model_dir, root / name, root / f"{name}.log", *models, *extra)

    with ThreadPoolExecutor(max_workers=2) as pool:
        starting = [pool.submit(start, "ranks", *placement), pool.submit(start, "one")]
    started = [future.result() for future in starting if future.exception() is None]
    try:
        for future in starting:
            future.result()  # a server that failed to start fails the test, naming why
        yield started[0], started[1]
    finally:
        for server in started:
            server.stop()


@pytest.fixture(scope="module")
def disaggregated(servers: tuple[ServerProcess, ServerProcess]) -> ServerProcess:
    return servers[0]


@pytest.fixture(scope="module")
def single(servers: tuple[ServerProcess, ServerProcess]) -> ServerProcess:
    return servers[1]


def health(server: ServerProcess) -> dict:
    with urllib.request.urlopen(f"{server.base_url}/api/v1/healthz", timeout=10) as answer:
        return json.loads(answer.read())


def _session(server: ServerProcess, model_dir: Path) -> dict:
    """Train, snapshot, sample (prompt and top-k logprobs), score, stable_reinforce on the
    recorded samples, and a base-model sampler."""
    service = server.service()
    training = service.create_lora_training_client(str(model_dir), rank=8, seed=3).result()
    tokenizer = training.get_tokenizer()
    result = _train(training, tokenizer, module=types)
    sampler = training.save_weights_and_get_sampling_client(record_stability_info=True).result()
    prompt = tokenizer.encode("78=")
    response = sampler.sample(
        types.ModelInput.from_ints(prompt),
        2,
        PARAMS,
        include_prompt_logprobs=True,
        topk_prompt_logprobs=2,
    ).result()
    result["recorded_tokens"] = [list(seq.tokens) for seq in response.sequences]
    result["recorded_logprobs"] = [list(seq.logprobs) for seq in response.sequences]
    result["prompt_logprobs"] = response.prompt_logprobs
    result["topk"] = response.topk_prompt_logprobs
    sequence = prompt + list(response.sequences[0].tokens)
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(sequence)).result()
    result["scored"] = scored
    data = [
        rl_datum(prompt, seq, adv) for seq, adv in zip(response.sequences, (1.0, -0.5), strict=True)
    ]
    result["stable"] = training.forward_backward(data, "stable_reinforce").result().metrics
    base = service.create_sampling_client(base_model=str(model_dir)).result()
    base_sample = base.sample(types.ModelInput.from_ints(prompt), 2, PARAMS).result()
    result["base_tokens"] = [list(seq.tokens) for seq in base_sample.sequences]
    result["base_logprobs"] = [list(seq.logprobs) for seq in base_sample.sequences]
    service.close("success").result()
    return result


def test_the_sdk_on_a_disaggregated_server_matches_one_process(disaggregated, single, model_dir):
    ranks = health(disaggregated)["ranks"]
    assert [(r["rank"], r["role"], r["alive"]) for r in ranks] == [
        (0, "trainer", True),
        (1, "generator", True),
        (2, "generator", True),
    ]
    assert len({r["pid"] for r in ranks}) == 3
    ours = _session(disaggregated, model_dir)
    reference = _session(single, model_dir)
    _assert_close(ours, reference)
    for key in ("recorded_tokens", "base_tokens"):
        assert ours[key] == reference[key], key
    for key in ("recorded_logprobs", "base_logprobs"):
        for mine, theirs in zip(ours[key], reference[key], strict=True):
            assert mine == pytest.approx(theirs, rel=1e-4, abs=1e-5), key
    assert ours["prompt_logprobs"][0] is None
    assert ours["prompt_logprobs"][1:] == pytest.approx(reference["prompt_logprobs"][1:], abs=1e-5)
    assert [[t for t, _ in row] for row in ours["topk"][1:]] == [
        [t for t, _ in row] for row in reference["topk"][1:]
    ]
    assert ours["scored"][1:] == pytest.approx(reference["scored"][1:], abs=1e-5)
    for name, value in reference["stable"].items():
        assert ours["stable"][name] == pytest.approx(value, rel=1e-4, abs=1e-5), name


def _models_session(server: ServerProcess, *, model_dir: Path, teacher_dir: Path, grader_dir: Path):
    """A LoRA model trained, snapshotted, sampled and scored on each trainable model, and the
    sample-only grader sampled and scored."""
    service = server.service()
    result = {}
    sequence = types.ModelInput.from_ints([1, 2, 3, 4, 5])
    for name, directory, seed in (("student", model_dir, 1), ("teacher", teacher_dir, 2)):
        training = service.create_lora_training_client(str(directory), rank=4, seed=seed).result()
        result[name] = _train(training, training.get_tokenizer(), module=types)
        snapshot = training.save_weights_and_get_sampling_client().result()
        result[f"{name}_scored"] = snapshot.compute_logprobs(sequence).result()
    grader = service.create_sampling_client(base_model=str(grader_dir)).result()
    sample = grader.sample(types.ModelInput.from_ints([1, 2, 3]), 2, PARAMS).result()
    result["grader_tokens"] = [list(seq.tokens) for seq in sample.sequences]
    result["grader_logprobs"] = [list(seq.logprobs) for seq in sample.sequences]
    result["grader_scored"] = grader.compute_logprobs(sequence).result()
    service.close("success").result()
    return result


def test_two_models_and_a_sample_only_one_on_generator_ranks_match_one_process(
    disaggregated, single, model_dir, teacher_dir, grader_dir
):
    dirs = {"model_dir": model_dir, "teacher_dir": teacher_dir, "grader_dir": grader_dir}
    ours = _models_session(disaggregated, **dirs)
    reference = _models_session(single, **dirs)
    for name in ("student", "teacher"):
        _assert_close(ours[name], reference[name])
    assert ours["student"]["losses"] != pytest.approx(ours["teacher"]["losses"])
    assert ours["grader_tokens"] == reference["grader_tokens"]
    for mine, theirs in zip(ours["grader_logprobs"], reference["grader_logprobs"], strict=True):
        assert mine == pytest.approx(theirs, rel=1e-4, abs=1e-5)
    for key in ("student_scored", "teacher_scored", "grader_scored"):
        assert ours[key][0] is None
        assert ours[key][1:] == pytest.approx(reference[key][1:], rel=1e-4, abs=1e-5), key
    assert ours["teacher_scored"][1:] != pytest.approx(ours["student_scored"][1:])
    assert "Traceback" not in disaggregated.log.read_text()


def test_inflight_clients_sample_a_target_on_the_generator_ranks(disaggregated, model_dir):
    """The model's in-flight target lives on the generator ranks; each in-flight save reaches
    the ranks holding it, and a sample in progress there goes on with the newer adapter."""
    every_client_samples_the_newest_save(disaggregated, model_dir)
    a_long_sample_spans_a_save(disaggregated, model_dir)


def test_a_killed_generator_rank_leaves_the_server_serving(disaggregated, model_dir):
    prompt = types.ModelInput.from_ints([1, 2, 3])
    alice = disaggregated.service()
    bob = disaggregated.service()
    a = alice.create_lora_training_client(str(model_dir), rank=4, seed=1).result()
    b = bob.create_lora_training_client(str(model_dir), rank=4, seed=2).result()
    # Made and sampled while both generators are idle: held by the first one only.
    only_on_first = a.save_weights_and_get_sampling_client().result()
    before = only_on_first.sample(prompt, 2, PARAMS).result()
    busy = b.save_weights_and_get_sampling_client().result()
    long = types.SamplingParams(max_tokens=24, temperature=1.0, seed=4, stop=[])
    in_flight = [busy.sample(prompt, 4, long) for _ in range(12)]
    first = next(r for r in health(disaggregated)["ranks"] if r["role"] == "generator")
    os.kill(first["pid"], signal.SIGKILL)
    answers = [future.result(timeout=120) for future in in_flight]  # retried on the survivor
    assert all(len(answer.sequences) == 4 for answer in answers)
    ranks = {r["rank"]: r["alive"] for r in health(disaggregated)["ranks"]}
    assert ranks == {0: True, 1: False, 2: True}
    after = only_on_first.sample(prompt, 2, PARAMS).result()  # reloaded on the survivor
    assert [s.tokens for s in after.sequences] == [s.tokens for s in before.sequences]
    assert [s.logprobs for s in after.sequences] == [s.logprobs for s in before.sequences]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 1.0, 1.0]},
    )
    b.forward_backward([datum], "cross_entropy").result()
    b.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    fresh = b.save_weights_and_get_sampling_client().result()
    assert len(fresh.sample(prompt, 2, PARAMS).result().sequences) == 2
    for service in (alice, bob):
        service.close("success").result()


def test_sigterm_stops_every_rank_cleanly(disaggregated):
    """Last on this server: SIGTERM to the command ends every rank (the trainer ranks, the
    generator ranks, the one killed above aside) with exit status 0 and nothing aborted."""
    pids = [rank["pid"] for rank in health(disaggregated)["ranks"] if rank["alive"]]
    disaggregated.stop()
    log = disaggregated.log.read_text()
    assert disaggregated.process.returncode == 0, log[-4000:]
    assert "Fatal Python error" not in log and "exception calling callback" not in log
    assert "1 trainer rank, 2 generator ranks" in log  # the startup line
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_placement_that_does_not_fit_is_refused_before_starting(model_dir, capsys):
    from temper.cli import main

    model = ["serve", "--model", str(model_dir)]
    assert main([*model, *DISAGGREGATED, "--placement.generator_ranks", "3"]) == 2
    error = capsys.readouterr().err
    assert "--placement.generator_ranks 3" in error and "--nproc 3" in error
    assert main([*model, "--placement.mode", "disaggregated"]) == 2
    assert "needs --nproc N" in capsys.readouterr().err
    assert main([*model, "--nproc", "2", "--placement.generator_ranks", "2"]) == 2
    assert "--placement.mode disaggregated" in capsys.readouterr().err
