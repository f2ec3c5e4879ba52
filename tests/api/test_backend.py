"""The in-process clients satisfy the backend Protocols the server calls through."""

from __future__ import annotations

import inspect

from temper.api.backend import SamplingBackend, ServiceBackend, TrainingBackend
from temper.client.sampling_client import SamplingClient
from temper.client.service_client import ServiceClient
from temper.client.training_client import TrainingClient


def test_in_process_clients_implement_the_backend_verbs(tmp_path):
    service = ServiceClient(storage_dir=tmp_path)
    assert isinstance(service, ServiceBackend)
    training = service.create_lora_training_client("tiny", rank=2, run_id="run-a")
    assert isinstance(training, TrainingBackend)
    assert training.model_id == "run-a"
    assert isinstance(training.save_weights_and_get_sampling_client(), SamplingBackend)


def test_protocol_parameters_exist_on_the_clients():
    pairs = [
        (ServiceBackend, ServiceClient),
        (TrainingBackend, TrainingClient),
        (SamplingBackend, SamplingClient),
    ]
    for protocol, cls in pairs:
        for name, member in vars(protocol).items():
            if name.startswith("_") or not callable(member):
                continue
            wanted = set(inspect.signature(member).parameters)
            assert wanted <= set(inspect.signature(getattr(cls, name)).parameters), name
