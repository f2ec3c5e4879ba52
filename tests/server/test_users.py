"""Users of one `temper serve --key-file`: each sees and uses only what it created.

Alice trains, saves and samples through the tinker SDK. Bob then tries every route on her
ids (raw HTTP where the SDK cannot aim at another user's ids): each answers 404 exactly as an
id that never existed does, and nothing of hers changed (her model's forward is bitwise the
same, her checkpoints and session are there). Listings are scoped; an admin sees all. The key
file is reloaded on SIGHUP and by an admin's POST /admin/reload_keys.
"""

from __future__ import annotations

import signal
import time

import httpx
import pytest
import tinker
from tinker import types

from temper.server.http.users import add_user
from tests.server.conftest import start_server
from tests.server.test_sdk import datum

ADAM = types.AdamParams(learning_rate=1e-2)


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    key_file = tmp_path_factory.mktemp("keys") / "users.json"
    names = {"alice": False, "bob": False, "root": True}
    return key_file, {name: add_user(key_file, name, admin=admin) for name, admin in names.items()}


@pytest.fixture(scope="module")
def team_server(model_dir, keys, tmp_path_factory):
    key_file, _ = keys
    root = tmp_path_factory.mktemp("team")
    server = start_server(
        model_dir, root / "storage", root / "server.log", "--key-file", str(key_file)
    )
    yield server
    server.stop()


def http(server, key: str, method: str, path: str, **kwargs) -> httpx.Response:
    return httpx.request(
        method,
        f"{server.base_url}/api/v1/{path}",
        headers={"X-API-Key": key},
        timeout=30,
        **kwargs,
    )


@pytest.fixture(scope="module")
def alice(team_server, keys, model_dir):
    """Alice's session: a LoRA model after one step, a training and a sampler checkpoint, a
    snapshot and a finished request."""
    _, key_of = keys
    service = team_server.service(api_key=key_of["alice"])
    training = service.create_lora_training_client(str(model_dir), rank=4, seed=0).result()
    tokenizer = training.get_tokenizer()
    example = datum(tokenizer, "12+34=46")
    training.forward_backward([example], "cross_entropy").result()
    training.optim_step(ADAM).result()
    state = training.save_state("a1").result().path
    sampler_path = training.save_weights_for_sampler("s1").result().path
    snapshot = training.save_weights_and_get_sampling_client().result()
    session = training.model_id.split(":")[0]  # model ids are <session>:train:<n>
    (sampler_id,) = (
        team_server.rest(api_key=key_of["alice"]).get_session(session).result().sampler_ids
    )
    request = http(
        team_server,
        key_of["alice"],
        "POST",
        "optim_step",
        json={"model_id": training.model_id, "adam_params": {"learning_rate": 0.0}},
    ).json()["request_id"]
    yield {
        "service": service,
        "training": training,
        "example": example,
        "session": session,
        "model": training.model_id,
        "state": state,
        "sampler_path": sampler_path,
        "snapshot": snapshot,
        "sampler_id": sampler_id,
        "request": request,
    }
    service.close("success").result()


def alices_forward(alice) -> list[float]:
    output = alice["training"].forward([alice["example"]], "cross_entropy").result()
    return output.loss_fn_outputs[0]["logprobs"].tolist()


def bobs_attempts(alice):
    """(method, path, kwargs) of every route that names one of Alice's ids."""
    model, session = alice["model"], alice["session"]
    run, state = model, alice["state"]
    checkpoint_id = state.split("/", 3)[3]
    return [
        ("GET", f"sessions/{session}", {}),
        ("POST", f"sessions/{session}/finish", {}),
        ("POST", "get_info", {"json": {"model_id": model}}),
        (
            "POST",
            "optim_step",
            {"json": {"model_id": model, "adam_params": {"learning_rate": 1.0}}},
        ),
        ("POST", "save_weights", {"json": {"model_id": model, "path": "bob"}}),
        ("POST", "save_weights_for_sampler", {"json": {"model_id": model}}),
        ("POST", "load_weights", {"json": {"model_id": model, "path": state, "optimizer": False}}),
        (
            "POST",
            "create_model",
            {"json": {"session_id": session, "model_seq_id": 9, "base_model": "x"}},
        ),
        (
            "POST",
            "create_sampling_session",
            {"json": {"session_id": session, "sampling_session_seq_id": 9, "base_model": "x"}},
        ),
        ("GET", f"samplers/{alice['sampler_id']}", {}),
        (
            "POST",
            "asample",
            {
                "json": {
                    "sampling_session_id": alice["sampler_id"],
                    "prompt": {"chunks": [{"tokens": [1, 2], "type": "encoded_text"}]},
                    "sampling_params": {"max_tokens": 2},
                    "num_samples": 1,
                }
            },
        ),
        ("POST", "retrieve_future", {"json": {"request_id": alice["request"]}}),
        ("GET", f"training_runs/{run}", {}),
        ("GET", f"training_runs/{run}/checkpoints", {}),
        ("DELETE", f"training_runs/{run}/checkpoints/{checkpoint_id}", {}),
        (
            "PUT",
            f"training_runs/{run}/checkpoints/{checkpoint_id}/ttl",
            {"json": {"ttl_seconds": 3600}},
        ),
        ("POST", "weights_info", {"json": {"tinker_path": state}}),
    ]


def test_another_users_ids_answer_404_and_change_nothing(team_server, keys, alice):
    _, key_of = keys
    before = alices_forward(alice)
    rest_alice = team_server.rest(api_key=key_of["alice"])
    saved_before = rest_alice.list_checkpoints(alice["model"]).result().checkpoints

    for method, path, kwargs in bobs_attempts(alice):
        response = http(team_server, key_of["bob"], method, path, **kwargs)
        assert response.status_code == 404, (method, path, response.status_code, response.text)
        assert response.json()["category"] == "user"
        assert "alice" not in response.text  # never names the owner

    # The SDK's own calls on her paths fail the same way.
    bob = team_server.service(api_key=key_of["bob"])
    with pytest.raises(tinker.NotFoundError):
        bob.create_training_client_from_state(alice["state"]).result()
    with pytest.raises(tinker.NotFoundError):
        bob.create_sampling_client(model_path=alice["sampler_path"]).result().sample(
            types.ModelInput.from_ints([1, 2]), 1, types.SamplingParams(max_tokens=2)
        ).result()
    bob.close("success").result()

    # Nothing of Alice's changed: same forward, same checkpoints, session alive.
    assert alices_forward(alice) == before
    assert rest_alice.list_checkpoints(alice["model"]).result().checkpoints == saved_before
    assert rest_alice.get_session(alice["session"]).result().training_run_ids == [alice["model"]]
    sample = alice["snapshot"].sample(
        types.ModelInput.from_ints([1, 2]), 1, types.SamplingParams(max_tokens=2, seed=0)
    )
    assert len(sample.result().sequences) == 1


def test_an_unknown_id_and_another_users_id_answer_alike(team_server, keys, alice):
    _, key_of = keys
    theirs = http(team_server, key_of["bob"], "POST", "get_info", json={"model_id": alice["model"]})
    made_up = alice["model"].replace(alice["session"], "sess-0000000000000000")
    unknown = http(team_server, key_of["bob"], "POST", "get_info", json={"model_id": made_up})
    assert theirs.status_code == unknown.status_code == 404
    assert theirs.json()["detail"].replace(alice["model"], "ID") == unknown.json()[
        "detail"
    ].replace(made_up, "ID")


def test_listings_are_scoped_and_an_admin_sees_all(team_server, keys, alice):
    _, key_of = keys
    rest_bob = team_server.rest(api_key=key_of["bob"])
    runs = [run.training_run_id for run in rest_bob.list_training_runs().result().training_runs]
    assert alice["model"] not in runs
    assert all(
        not c.tinker_path.startswith(f"tinker://{alice['model']}/")
        for c in rest_bob.list_user_checkpoints().result().checkpoints
    )
    assert alice["session"] not in rest_bob.list_sessions().result().sessions

    rest_alice = team_server.rest(api_key=key_of["alice"])
    mine = rest_alice.list_training_runs().result().training_runs
    assert [run.training_run_id for run in mine] == [alice["model"]]
    assert mine[0].model_owner == "alice"
    assert alice["session"] in rest_alice.list_sessions().result().sessions

    rest_root = team_server.rest(api_key=key_of["root"])
    every_run = [r.training_run_id for r in rest_root.list_training_runs().result().training_runs]
    assert alice["model"] in every_run
    assert rest_root.get_training_run(alice["model"]).result().model_owner == "alice"
    assert rest_root.get_session(alice["session"]).result().training_run_ids == [alice["model"]]
    listed = http(
        team_server, key_of["root"], "GET", "sessions", params={"access_scope": "accessible"}
    )
    assert alice["session"] in listed.json()["sessions"]


def test_a_wrong_key_is_refused(team_server):
    response = http(team_server, "tml-not-a-key-of-anybody-000", "GET", "training_runs")
    assert response.status_code == 401
    # A health probe needs no key (it tells nothing but that the server is up).
    assert http(team_server, "tml-not-a-key-of-anybody-000", "GET", "healthz").status_code == 200


def test_the_key_file_reloads_on_sighup_and_by_an_admin(team_server, keys):
    key_file, key_of = keys
    carol = add_user(key_file, "carol")
    assert http(team_server, carol, "GET", "training_runs").status_code == 401  # not yet read
    refused = http(team_server, key_of["alice"], "POST", "admin/reload_keys")
    assert refused.status_code == 403
    reloaded = http(team_server, key_of["root"], "POST", "admin/reload_keys")
    assert reloaded.status_code == 200 and reloaded.json() == {"users": 4}
    assert http(team_server, carol, "GET", "training_runs").status_code == 200

    dave = add_user(key_file, "dave")
    team_server.process.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while http(team_server, dave, "GET", "training_runs").status_code != 200:
        assert time.monotonic() < deadline, "SIGHUP did not reload the key file"
        time.sleep(0.2)

    key_file.write_text("{not json")  # a broken file keeps the users in place
    broken = http(team_server, key_of["root"], "POST", "admin/reload_keys")
    assert broken.status_code == 400 and "previous users stay" in broken.json()["detail"]
    assert http(team_server, dave, "GET", "training_runs").status_code == 200
