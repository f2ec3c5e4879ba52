"""Request fields and limits the SDK sends, driven by the unmodified tinker SDK.

One server (loopback, two users in a key file) serves the tiny model (context 2048, lowered to
96 by --sampler.max-seq-len) and a short model (context 48, below that setting), and lets a
user hold 2 models, ending silent sessions after 1 s when a user needs room.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import tinker
from tinker import types

from temper.server.http.users import add_user
from tests.server.conftest import start_server

CONTEXT = 96
"""--sampler.max-seq-len: lowers the tiny model's 2048."""
SHORT_CONTEXT = 48
"""The short model's own context, below the setting."""
NO_STOP = types.SamplingParams(max_tokens=500, temperature=0.0, stop=[])


def write_short_model(directory: Path) -> Path:
    """A random Qwen3 with the digits vocabulary and a context of SHORT_CONTEXT."""
    from temper.checkpoint.hf import save_pretrained
    from temper.models.build import materialize
    from temper.models.registry import family
    from temper.tokenizer import build_builtin_tokenizer

    tokenizer = build_builtin_tokenizer("digits")
    config = dataclasses.replace(
        family("qwen3").sizes["tiny"],
        vocab_size=tokenizer.vocab_size,
        dim=64,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=32,
        ffn_dim=64,
        max_seq_len=SHORT_CONTEXT,
    )
    model = materialize(config, device="cpu", dtype="float32", seed=5)
    save_pretrained(model, directory, tokenizer=tokenizer)
    return directory


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    key_file = tmp_path_factory.mktemp("keys") / "users.json"
    return key_file, {name: add_user(key_file, name, admin=False) for name in ("ana", "ben")}


@pytest.fixture(scope="module")
def server(model_dir, keys, tmp_path_factory):
    root = tmp_path_factory.mktemp("fields")
    short_dir = write_short_model(root / "models" / "short-digits")
    process = start_server(
        model_dir,
        root / "storage",
        root / "server.log",
        *("--model", str(short_dir), "--key-file", str(keys[0])),
        *("--sampler.max-seq-len", str(CONTEXT), "--sampler.max-batch", "8"),
        *("--session-silent-s", "1", "--max-models-per-user", "2"),
    )
    process.short_dir = short_dir
    yield process
    process.stop()


@pytest.fixture(scope="module")
def ben_key(keys):
    return keys[1]["ben"]


@pytest.fixture(scope="module")
def service(server, ben_key):
    client = server.service(api_key=ben_key)
    yield client
    client.close("success").result()


@pytest.fixture(scope="module")
def training(service, model_dir):
    return service.create_lora_training_client(str(model_dir), rank=4, seed=1).result()


def http(server, key: str, method: str, path: str, **kwargs) -> httpx.Response:
    url = f"{server.base_url}/api/v1/{path}"
    return httpx.request(method, url, headers={"X-API-Key": key}, timeout=30, **kwargs)


def test_dimuon_is_refused_on_every_route(service, training, model_dir):
    with pytest.raises(
        tinker.BadRequestError, match="create_model: optimizer_config type 'dimuon'"
    ):
        service.create_lora_training_client(
            str(model_dir), rank=4, optimizer=types.DimuonOptimizerConfig()
        ).result()
    path = training.save_state("before-dimuon").result().path
    with pytest.raises(
        tinker.BadRequestError, match="load_weights: optimizer_config type 'dimuon'"
    ):
        service.create_training_client_from_state(
            path, optimizer=types.DimuonOptimizerConfig()
        ).result()
    with pytest.raises(tinker.BadRequestError, match="optimizer 'dimuon' is not supported"):
        training.optim_step(types.DimuonParams(learning_rate=1e-3)).result()


def test_user_metadata_and_base_model_are_honoured(server, ben_key, service, training, model_dir):
    rest = server.rest(api_key=ben_key)
    state = training.save_state("meta", user_metadata={"step": "3"}).result().path
    sampler = training.save_weights_for_sampler("smeta", user_metadata={"kind": "eval"}).result()
    run_id = training.get_info().model_id
    listed = {
        c.tinker_path: c.user_metadata for c in rest.list_checkpoints(run_id).result().checkpoints
    }
    assert listed[state] == {"step": "3"}
    assert listed[sampler.path] == {"kind": "eval"}
    # Saving over a checkpoint replaces its metadata (none given: none left), as the SDK says.
    training.save_state("meta", overwrite=True).result()
    listed = {
        c.tinker_path: c.user_metadata for c in rest.list_checkpoints(run_id).result().checkpoints
    }
    assert listed[state] is None

    with pytest.raises(tinker.BadRequestError, match="load_weights: base_model"):
        service.create_training_client_from_state(state, base_model=str(server.short_dir)).result()
    loaded = service.create_training_client_from_state(
        state, base_model=f"{model_dir.name}:peft:262144", user_metadata={"origin": "meta"}
    ).result()
    run = rest.get_training_run(loaded.get_info().model_id).result()
    assert run.user_metadata == {"origin": "meta"}
    assert run.base_model == str(model_dir.resolve())


def test_a_live_session_at_its_users_limit_is_refused(service, training, model_dir):
    # Ben's session holds his 2 models (the previous test's) and is alive: nothing to reclaim.
    with pytest.raises(tinker.APIStatusError, match="--max-models-per-user") as refused:
        service.create_lora_training_client(str(model_dir), rank=4).result()
    assert refused.value.status_code == 429
    assert training.get_info().model_id  # still served


def test_project_id_is_accepted_and_logged(server, ben_key, model_dir):
    client = tinker.ServiceClient(base_url=server.base_url, api_key=ben_key, project_id="proj-7")
    client.create_sampling_client(base_model=str(model_dir)).result()  # starts the session
    client.close("success").result()
    assert "project 'proj-7' (not scoped)" in server.log.read_text()


def test_peft_suffix_names_the_base_model(service, model_dir):
    # The HF repo id form (`<parent>/<name>`), as the cookbook's rl_numerics_check names Qwen.
    repo_id = f"{model_dir.parent.name}/{model_dir.name}"
    sampler = service.create_sampling_client(base_model=f"{repo_id}:peft:262144").result()
    prompt = types.ModelInput.from_ints([3, 4, 5])
    result = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=2)).result()
    assert len(result.sequences[0].tokens) == 2


def test_sampling_session_creation_is_idempotent(server, ben_key, model_dir):
    session = http(server, ben_key, "POST", "create_session", json={
        "tags": [], "user_metadata": None, "sdk_version": "test",
    }).json()["session_id"]  # fmt: skip
    body = {"session_id": session, "sampling_session_seq_id": 0, "base_model": str(model_dir)}
    first = http(server, ben_key, "POST", "create_sampling_session", json=body)
    again = http(server, ben_key, "POST", "create_sampling_session", json=body)
    assert first.status_code == again.status_code == 200
    assert first.json()["sampling_session_id"] == again.json()["sampling_session_id"]
    assert http(server, ben_key, "GET", f"sessions/{session}").json()["sampler_ids"] == [
        first.json()["sampling_session_id"]
    ]
    other = http(server, ben_key, "POST", "create_sampling_session", json={
        **body, "base_model": str(server.short_dir),
    })  # fmt: skip
    assert other.status_code == 400 and "sampling_session_seq_id 0" in other.json()["detail"]
    http(server, ben_key, "POST", f"sessions/{session}/finish")


def test_prompt_cache_hit_tokens_count_the_prefix_cache(service, model_dir):
    sampler = service.create_sampling_client(base_model=str(model_dir)).result()
    params = types.SamplingParams(max_tokens=6, temperature=0.0, stop=[])
    prompt = [7, 1, 8, 2, 8, 1, 8, 2]
    first = sampler.sample(types.ModelInput.from_ints(prompt), 1, params).result()
    assert first.prompt_cache_hit_tokens == 0
    # The next turn extends the finished sequence: its keys/values (all but the last token,
    # which was never fed back) come from the prefix cache.
    turn = [*prompt, *first.sequences[0].tokens, 4, 5]
    second = sampler.sample(types.ModelInput.from_ints(turn), 2, params).result()
    assert second.prompt_cache_hit_tokens == len(prompt) + len(first.sequences[0].tokens) - 1


def test_each_model_samples_up_to_its_own_context(server, service, model_dir):
    prompt = types.ModelInput.from_ints([3, 4, 5, 6])
    for base, context in ((str(model_dir), CONTEXT), (str(server.short_dir), SHORT_CONTEXT)):
        sampler = service.create_sampling_client(base_model=base).result()
        (cut,) = sampler.sample(prompt, 1, NO_STOP).result().sequences
        assert (len(cut.tokens), cut.stop_reason) == (context - 4, "length")
        too_long = types.ModelInput.from_ints([3] * context)
        with pytest.raises(tinker.BadRequestError, match=f"holds at most {context} tokens"):
            sampler.sample(too_long, 1, NO_STOP).result()
    log = server.log.read_text()
    for context in (CONTEXT, SHORT_CONTEXT):
        assert f"stopped at the sampler's context of {context} tokens (prompt 4)" in log


DYING_SCRIPT = """
import os, sys, tinker
service = tinker.ServiceClient(base_url=sys.argv[1], api_key=sys.argv[2])
for seed in range(2):
    training = service.create_lora_training_client(sys.argv[3], rank=4, seed=seed).result()
    print(training.get_info().model_id, flush=True)
os._exit(1)  # dies without finishing its session
"""


def test_a_dead_scripts_models_do_not_lock_out_its_user(server, keys, model_dir):
    ana = keys[1]["ana"]
    died = subprocess.run(
        [sys.executable, "-c", DYING_SCRIPT, server.base_url, ana, str(model_dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    abandoned = died.stdout.split()
    assert died.returncode == 1 and len(abandoned) == 2, died.stderr
    time.sleep(1.5)  # past --session-silent-s: its heartbeats stopped with it
    service = server.service(api_key=ana)
    try:
        training = service.create_lora_training_client(str(model_dir), rank=4).result()
        assert training.get_info().model_id not in abandoned
        gone = http(server, ana, "POST", "get_info", json={"model_id": abandoned[0]})
        assert gone.status_code == 410 and "no heartbeat" in gone.json()["detail"]
    finally:
        service.close("success").result()
