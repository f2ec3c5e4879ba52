"""The record_stability_info store: lifetime restarted by use, a token limit, sessions."""

from __future__ import annotations

import numpy as np
import pytest

from temper.server.state.stability import SequenceRecord, StabilityStore


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def record(session_id: str = "s1", *, num_sampled: int = 3) -> SequenceRecord:
    return SequenceRecord(
        session_id=session_id,
        prompt_P=np.arange(2, dtype=np.int32),
        tokens_S=np.arange(num_sampled, dtype=np.int32),
        logprobs_S=np.full(num_sampled, -1.0, dtype=np.float32),
        weights="base",
        weights_version=0,
    )


def test_each_use_restarts_the_lifetime_and_an_unused_record_expires():
    clock = Clock()
    store = StabilityStore.Config(ttl_s=10).build(clock=clock)
    store.record("a", record())
    store.record("b", record())
    clock.now = 8
    store.touch({"a"})
    clock.now = 15  # 15 s after sampling, 7 s after "a" was last used
    assert store.lookup("a", session_id="s1").weights == "base"
    with pytest.raises(ValueError, match=r"sequence 'b' expired: it was not named .* for 10 s"):
        store.lookup("b", session_id="s1")
    clock.now = 18.5
    with pytest.raises(ValueError, match="sequence 'a' expired"):
        store.lookup("a", session_id="s1")
    assert len(store) == 0 and store.num_tokens == 0


def test_past_the_token_limit_the_least_recently_used_are_dropped():
    clock = Clock()
    store = StabilityStore.Config(max_tokens=12).build(clock=clock)
    for name in "abc":  # 5 tokens each (2 prompt + 3 sampled): "c" pushes "a" out
        clock.now += 1
        store.record(name, record())
    assert len(store) == 2 and store.num_tokens == 10
    with pytest.raises(ValueError, match="'a' was dropped: the server records at most 12 tokens"):
        store.lookup("a", session_id="s1")
    store.touch({"b"})  # now "c" is the least recently used
    store.record("d", record())
    store.lookup("b", session_id="s1")
    with pytest.raises(ValueError, match="'c' was dropped"):
        store.lookup("c", session_id="s1")


def test_records_belong_to_their_session():
    store = StabilityStore.Config().build()
    store.record("a", record("s1"))
    store.record("b", record("s2"))
    with pytest.raises(ValueError, match="'a' was sampled in another session"):
        store.lookup("a", session_id="s2")
    store.drop_session("s1")
    with pytest.raises(ValueError, match="unknown sequence 'a'"):
        store.lookup("a", session_id="s1")
    assert store.lookup("b", session_id="s2").session_id == "s2"


@pytest.mark.parametrize(
    ("fields", "message"), [({"ttl_s": 0}, "ttl_s must be > 0"), ({"max_tokens": 0}, ">= 1")]
)
def test_bad_config(fields, message):
    with pytest.raises(ValueError, match=message):
        StabilityStore.Config(**fields)
