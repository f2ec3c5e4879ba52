"""The SDK's sharing, export and futures routes against one `temper serve --key-file`, driven by
the unmodified tinker SDK (and its CLI for `tinker checkpoint download`).

Alice trains and saves; she publishes a checkpoint, which Bob then samples from, loads and
sees listed, but cannot change; unpublished, it is hers alone again, and a restarted server
reads the same publication from disk. Copies, external weights downloaded by the CLI, session
search, clones of a sampling client (join_sampling_session) and cancelled samples follow.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys

import httpx
import pytest
import tinker
from safetensors.torch import load_file
from tinker import types

from temper.checkpoint.storage import CheckpointPath, CheckpointStorage
from temper.server.http.users import add_user
from temper.server.state.catalog import CheckpointCatalog
from tests.server.conftest import start_server
from tests.server.test_sdk import datum

PARAMS = types.SamplingParams(max_tokens=3, temperature=1.0, seed=0)


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    key_file = tmp_path_factory.mktemp("keys") / "users.json"
    return key_file, {name: add_user(key_file, name) for name in ("alice", "bob")}


@pytest.fixture(scope="module")
def team(model_dir, keys, tmp_path_factory):
    key_file, _ = keys
    root = tmp_path_factory.mktemp("routes")
    server = start_server(
        model_dir, root / "storage", root / "server.log", "--key-file", str(key_file)
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def alice(team, keys, model_dir):
    """Alice's session with a trained LoRA model, a training and a sampler checkpoint."""
    service = team.service(api_key=keys[1]["alice"])
    training = service.create_lora_training_client(str(model_dir), rank=4, seed=0).result()
    training.forward_backward([datum(training.get_tokenizer(), "12=3")], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    state = training.save_state("state").result().path
    sampler = training.save_weights_for_sampler("shared").result().path
    yield service, training, state, sampler
    service.close("success").result()


def http(server, key: str, method: str, path: str, **kwargs) -> httpx.Response:
    url = f"{server.base_url}/api/v1/{path}"
    return httpx.request(method, url, headers={"X-API-Key": key}, timeout=30, **kwargs)


def test_published_checkpoints_are_readable_by_others_and_changeable_by_the_owner_only(
    team, keys, alice
):
    _, key_of = keys
    _, training, state, sampler = alice
    rest_alice, rest_bob = team.rest(key_of["alice"]), team.rest(key_of["bob"])
    bob = team.service(api_key=key_of["bob"])
    with pytest.raises(tinker.NotFoundError):
        bob.create_sampling_client(model_path=sampler).sample(
            types.ModelInput.from_ints([1, 2]), 1, PARAMS
        ).result()

    rest_alice.publish_checkpoint_from_tinker_path(sampler).result()
    rest_alice.publish_checkpoint_from_tinker_path(state).result()
    with pytest.raises(tinker.BadRequestError, match="already published"):
        rest_alice.publish_checkpoint_from_tinker_path(sampler).result()

    samples = bob.create_sampling_client(model_path=sampler).sample(
        types.ModelInput.from_ints([1, 2]), 2, PARAMS
    )
    assert len(samples.result().sequences) == 2
    loaded = bob.create_training_client_from_state(state).result()
    data = [datum(training.get_tokenizer(), "12=3")]
    assert loaded.forward(data, "cross_entropy").result().metrics
    listed = rest_bob.list_checkpoints(training.model_id).result().checkpoints
    assert {c.tinker_path for c in listed} == {state, sampler}
    assert all(c.public for c in listed)
    assert rest_bob.get_weights_info_by_tinker_path(sampler).result().is_lora
    for change in (
        lambda: rest_bob.unpublish_checkpoint_from_tinker_path(sampler).result(),
        lambda: rest_bob.delete_checkpoint_from_tinker_path(sampler).result(),
        lambda: rest_bob.set_checkpoint_ttl_from_tinker_path(sampler, 7200).result(),
    ):
        with pytest.raises(tinker.NotFoundError):
            change()

    # Kept on disk: a restarted server reads the same.
    restarted = CheckpointCatalog(CheckpointStorage(team.storage))
    assert restarted.publication.is_published(CheckpointPath.parse(sampler))

    rest_alice.unpublish_checkpoint_from_tinker_path(sampler).result()
    with pytest.raises(tinker.BadRequestError, match="already not published"):
        rest_alice.unpublish_checkpoint_from_tinker_path(sampler).result()
    with pytest.raises(tinker.NotFoundError):
        rest_bob.get_weights_info_by_tinker_path(sampler).result()
    assert {
        c.tinker_path for c in rest_bob.list_checkpoints(training.model_id).result().checkpoints
    } == {state}
    rest_alice.unpublish_checkpoint_from_tinker_path(state).result()
    with pytest.raises(tinker.NotFoundError):
        rest_bob.list_checkpoints(training.model_id).result()
    bob.close("success").result()


def test_copy_weights_makes_a_run_of_the_caller_that_samples_like_the_source(team, keys, alice):
    _, key_of = keys
    _, _, _, sampler = alice
    rest = team.rest(key_of["alice"])
    copied = rest.copy_weights(sampler, "archive", ttl_seconds=7200).result()
    parsed = CheckpointPath.parse(copied)
    assert parsed.kind == "sampler_weights" and parsed.name == "shared"
    listed = rest.list_checkpoints(parsed.run_id).result().checkpoints
    assert [c.tinker_path for c in listed] == [copied] and listed[0].expires_at is not None
    service = team.service(api_key=key_of["alice"])
    prompt = types.ModelInput.from_ints([1, 2, 3])
    greedy = types.SamplingParams(max_tokens=4, temperature=0.0)
    tokens = [
        service.create_sampling_client(model_path=path).sample(prompt, 1, greedy).result()
        for path in (sampler, copied)
    ]
    assert tokens[0].sequences[0].tokens == tokens[1].sequences[0].tokens
    with pytest.raises(tinker.NotFoundError):  # Bob cannot copy what Alice did not publish
        team.rest(key_of["bob"]).copy_weights(sampler, "mine").result()
    service.close("success").result()


def test_the_cli_downloads_a_training_checkpoint_as_a_peft_adapter(team, keys, alice, tmp_path):
    _, key_of = keys
    _, training, state, _ = alice
    env = {
        **os.environ,
        "TINKER_BASE_URL": team.base_url,
        "TINKER_API_KEY": key_of["alice"],
        "TINKER_TELEMETRY": "0",
    }
    command = [sys.executable, "-m", "tinker.cli", "checkpoint", "download", state]
    result = subprocess.run(
        [*command, "--output", str(tmp_path)], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    downloaded = tmp_path / state.removeprefix("tinker://").replace("/", "_")
    config = json.loads((downloaded / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4
    adapters = load_file(str(downloaded / "adapter_model.safetensors"))
    assert adapters and all(key.startswith("base_model.model.") for key in adapters)
    # The same tensors as the model's own sampler weights, under PEFT's names.
    sampler_dir = team.storage / training.model_id / "sampler_weights" / "shared"
    assert sum(t.numel() for t in adapters.values()) == sum(
        t.numel() for t in load_file(str(sampler_dir / "lora.safetensors")).values()
    )
    # The temporary export was deleted after the download.
    kinds = {
        c.checkpoint_type
        for c in team.rest(key_of["alice"]).list_user_checkpoints().result().checkpoints
    }
    assert "external" not in kinds


def test_external_weights_urls_are_signed_and_checked(team, keys, alice):
    _, key_of = keys
    _, training, _, _ = alice
    path = training.save_weights_external("export").result().path
    urls = team.rest(key_of["alice"]).get_external_weights_urls(path).result().urls
    assert "adapter_model.safetensors" in urls
    url = urls["adapter_config.json"]
    assert httpx.get(url).json()["peft_type"] == "LORA"  # no key: the signature is the proof
    assert httpx.get(url.replace("signature=", "signature=0")).status_code == 403
    with pytest.raises(tinker.NotFoundError):  # another user's export
        team.rest(key_of["bob"]).get_external_weights_urls(path).result()
    with pytest.raises(tinker.BadRequestError, match="exist already"):
        training.save_weights_external("export").result()


def test_session_search_finds_sessions_by_name_and_metadata_a_page_at_a_time(team, keys):
    _, key_of = keys
    services = [
        tinker.ServiceClient(
            base_url=team.base_url,
            api_key=key_of["bob"],
            display_name=f"nightly run {index}",
            user_metadata={"index": str(index)},
        )
        for index in range(3)
    ]
    for service in services:
        assert service.holder.get_session_id()  # the SDK creates a session on first use
    rest = team.rest(key_of["bob"])
    request = types.SessionSearchRequest(display_name="NIGHTLY", limit=2)
    first = rest.search_sessions(request).result()
    assert [s.display_name for s in first.sessions] == ["nightly run 2", "nightly run 1"]
    second = rest.search_sessions(request.model_copy(update={"cursor": first.next_cursor})).result()
    assert [s.display_name for s in second.sessions] == ["nightly run 0"]
    assert second.next_cursor is None
    by_metadata = rest.search_sessions(
        types.SessionSearchRequest(user_metadata={"index": "1"})
    ).result()
    assert [s.display_name for s in by_metadata.sessions] == ["nightly run 1"]
    assert by_metadata.sessions[0].owner == "bob"
    alice_sees = team.rest(key_of["alice"]).search_sessions(request).result()
    assert alice_sees.sessions == []
    for service in services:
        service.close("success").result()


def test_sampling_clones_join_and_cancelled_samples_answer_cancelled(team, keys, alice):
    _, key_of = keys
    _, training, _, _ = alice
    sampler = training.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints([1, 2])
    assert sampler.sample(prompt, 1, PARAMS).result().sequences
    clone = pickle.loads(pickle.dumps(sampler))
    assert clone.sample(prompt, 1, PARAMS).result().sequences
    assert clone._cloned_sampler_id == 1  # allocated by join_sampling_session
    joined = http(
        team,
        key_of["alice"],
        "POST",
        "join_sampling_session",
        json={"sampling_session_id": sampler._sampling_session_id},
    )
    assert joined.json()["client_counter"] == 2

    key = key_of["alice"]
    long = types.SamplingParams(max_tokens=200, temperature=1.0)
    future = http(
        team,
        key,
        "POST",
        "asample",
        json={
            "sampling_session_id": sampler._sampling_session_id,
            "prompt": prompt.model_dump(mode="json"),
            "num_samples": 1,
            "sampling_params": long.model_dump(mode="json"),
        },
    ).json()
    cancel = {"request_id": future["request_id"]}
    assert http(team, key_of["bob"], "POST", "cancel_future", json=cancel).status_code == 404
    assert http(team, key, "POST", "cancel_future", json=cancel).status_code == 204
    # Held, running or (on a fast machine) finished when the cancel came: its result is
    # dropped either way (test_cancel.py pins down each case).
    answer = http(team, key, "POST", "retrieve_future", json=cancel)
    if answer.status_code != 404:
        assert "cancelled by its client" in answer.json()["error"]


@pytest.mark.parametrize(
    ("method", "path", "served"),
    [
        ("POST", "sessions/search", True),
        ("POST", "training_runs/r/checkpoints/weights/x/publish", True),
        ("DELETE", "training_runs/r/checkpoints/weights/x/publish", True),
        ("GET", "training_runs/r/checkpoints/external_weights/x/external_weights_urls", True),
        ("POST", "create_custom_loss", False),
        ("PUT", "sessions/s/project", False),
        ("GET", "billing/usage/events", False),
    ],
)
def test_each_sdk_path_reaches_its_own_route(team, keys, method, path, served):
    response = http(team, keys[1]["alice"], method, path, json={})
    assert response.status_code not in (405, 500)
    detail = response.json().get("detail", "")
    if served:  # its own handler: a 404 for the unknown run, or an answer
        assert "must look like" not in detail and "not served" not in detail, detail
    else:
        assert response.status_code == 404 and "is not served by Temper" in detail
