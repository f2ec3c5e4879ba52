"""vLLM's own processes dying under a weight update (engine_process='separate', vLLM's CPU
build): a worker killed mid-update fails the update within its deadline + 5 s, naming the
phase and how far it got; the generator then refuses calls, saying why, and closing it
returns. `make test-vllm` runs these."""

from __future__ import annotations

import threading
import time

import pytest

from tests.generator.test_vllm_transfer import SMALL_BUCKET, _model, _perturbed

pytest.importorskip("vllm", reason="the vllm extra is not installed (make vllm)")
pytestmark = pytest.mark.vllm

from temper.api import SamplingParams  # noqa: E402
from temper.generator import vllm_transfer  # noqa: E402
from temper.generator.vllm import VllmGenerator  # noqa: E402
from temper.sampler.engine import SampleRequest  # noqa: E402

DEADLINE_S = 20.0
GRACE_S = 5.0
CLOSE_GUARD_S = 120.0
"""A hang guard for `close`, not a speed check."""


def test_a_worker_killed_mid_update_fails_it_in_time_and_the_generator_refuses_calls(
    monkeypatch,
):
    monkeypatch.setattr(vllm_transfer, "BUCKET_BYTES", SMALL_BUCKET)
    monkeypatch.setenv(vllm_transfer.FAULT_ENV, "3:exit")  # the worker ends at bucket 3
    model, tokenizer = _model()
    config = VllmGenerator.Config(
        kv_cache_mib=32, engine_process="separate", sync_timeout_s=DEADLINE_S
    )
    vllm = config.build(model=model, tokenizer=tokenizer)
    try:
        started = time.monotonic()
        with pytest.raises(RuntimeError) as raised:
            vllm.update_weights(_perturbed(model, seed=1), version=1)
        took = time.monotonic() - started
        message = str(raised.value)
        assert took < DEADLINE_S + GRACE_S, (took, message)
        assert "worker rank 1" in message and "phase update_weights" in message, message
        assert "after 2 bucket(s)" in message, message  # how far it got
        assert "stopped" in message, message  # it died; it did not stall
        request = SampleRequest(prompt=[1, 2, 3], params=SamplingParams(max_tokens=2))
        with pytest.raises(ValueError, match=r"failed part-way.*build a new generator"):
            vllm.generate([request])
    finally:
        closing = threading.Thread(target=vllm.close, daemon=True)
        closing.start()
        closing.join(CLOSE_GUARD_S)
        assert not closing.is_alive(), "closing a generator whose worker died hung"
