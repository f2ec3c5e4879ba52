"""Session routes through the SDK: `RestClient.list_sessions` (newest first, in pages) and
`RestClient.get_session` (its training runs, live samplers, metadata and display name)."""

from __future__ import annotations

import pytest
import tinker

from tests.server.conftest import API_KEY


def test_sessions_are_listed_and_described(server, model_dir):
    service = tinker.ServiceClient(
        user_metadata={"team": "prefs"},
        display_name="dpo run",
        base_url=server.base_url,
        api_key=API_KEY,
    )
    training = service.create_lora_training_client(str(model_dir), rank=4, seed=0).result()
    training.save_weights_and_get_sampling_client().result()
    session_id = training.model_id.split(":")[0]  # model ids are <session>:train:<n>
    later = server.service()
    later_id = later.create_lora_training_client(str(model_dir), rank=4).result().model_id
    rest = server.rest()

    sessions = rest.list_sessions().result().sessions
    assert sessions.index(later_id.split(":")[0]) < sessions.index(session_id)
    assert rest.list_sessions(limit=1).result().sessions == sessions[:1]
    assert rest.list_sessions(limit=1, offset=1).result().sessions == sessions[1:2]

    described = rest.get_session(session_id).result()
    assert described.training_run_ids == [training.model_id]
    assert len(described.sampler_ids) == 1
    assert rest.get_sampler(described.sampler_ids[0]).result().base_model
    assert described.user_metadata == {"team": "prefs"}
    assert described.display_name == "dpo run"

    service.close("success").result()
    with pytest.raises(tinker.APIStatusError, match="was finished by its client") as gone:
        rest.get_session(session_id).result()
    assert gone.value.status_code == 410
    with pytest.raises(tinker.BadRequestError, match=r"limit must be in 1\.\.1000"):
        rest.list_sessions(limit=0).result()
    later.close("success").result()
