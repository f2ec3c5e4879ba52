"""SampleCoalescer: a burst of samples for one client starts together; nothing waits forever;
a burst the size of its lineage's last one starts at once, as does every full wave of the
sampler's slots; a burst that arrived slowly still teaches its whole size."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from temper.server.dispatch.coalescer import SampleCoalescer
from temper.server.state.server import TemperServer


class Client:
    """Stands for a backend sampling client (the coalescer holds clients weakly)."""

    def batch(self):
        return contextlib.nullcontext()


def run_burst(
    coalescer: SampleCoalescer,
    arrivals: list[tuple[object, str]],
    *,
    pause_s: float = 0.0,
    num_sequences: int = 1,
):
    """Add `arrivals` (client, name) `pause_s` apart, each a request for `num_sequences`
    samples; returns the groups started together.

    A flush runs its starts back to back in one callback, so starts before the next loop
    iteration belong to one group.
    """
    groups: list[list[str]] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        done = asyncio.Event()
        open_group: list[list[str] | None] = [None]

        def close_group() -> None:
            open_group[0] = None

        def start(name: str):
            def run() -> None:
                if open_group[0] is None:
                    open_group[0] = []
                    groups.append(open_group[0])
                    loop.call_soon(close_group)
                open_group[0].append(name)
                if sum(map(len, groups)) == len(arrivals):
                    done.set()

            return run

        for client, name in arrivals:
            coalescer.add(client, start(name), lineage="policy", num_sequences=num_sequences)
            await asyncio.sleep(pause_s)
        await asyncio.wait_for(done.wait(), timeout=30)

    asyncio.run(main())
    return groups


def test_a_burst_on_one_client_starts_together_and_clients_are_separate():
    coalescer = SampleCoalescer(0.2, max_hold_s=10.0)
    one, two = Client(), Client()
    groups = run_burst(coalescer, [(one, "a"), (two, "x"), (one, "b"), (one, "c")], pause_s=0.01)
    assert sorted(map(sorted, groups)) == [["a", "b", "c"], ["x"]]


def test_a_steady_stream_still_starts_after_the_longest_hold():
    # Each arrival would push the flush back by a minute; the hold cap starts them anyway.
    coalescer = SampleCoalescer(60.0, max_hold_s=0.05)
    client = Client()
    groups = run_burst(coalescer, [(client, "a"), (client, "b")])
    assert sorted(name for group in groups for name in group) == ["a", "b"]


def test_a_burst_the_size_of_the_last_one_starts_without_waiting_and_growth_is_learned():
    coalescer = SampleCoalescer(0.3, max_hold_s=10.0)
    first, second, third = Client(), Client(), Client()
    assert run_burst(coalescer, [(first, name) for name in "abc"]) == [["a", "b", "c"]]
    # Larger than expected: the first three start at once, the other two after the gap.
    groups = run_burst(coalescer, [(second, name) for name in "abcde"], pause_s=0.01)
    assert groups == [["a", "b", "c"], ["d", "e"]]
    # Five is now expected: with a one-minute gap, only starting early finishes in time.
    coalescer.window_s = 60.0
    assert run_burst(coalescer, [(third, name) for name in "abcde"]) == [list("abcde")]


def test_each_full_wave_of_sampler_slots_starts_without_waiting_for_the_rest():
    # Two requests of 8 fill the 16 slots; with a one-minute gap and hold, only the
    # capacity rule can start them, and the fifth waits for its own wave.
    coalescer = SampleCoalescer(60.0, max_hold_s=60.0, capacity=16)
    client = Client()
    groups = run_burst(coalescer, [(client, name) for name in "abcd"], num_sequences=8)
    assert groups == [["a", "b"], ["c", "d"]]


def test_a_request_larger_than_the_slots_starts_at_once_and_alone():
    coalescer = SampleCoalescer(60.0, max_hold_s=60.0, capacity=16)
    client = Client()
    assert run_burst(coalescer, [(client, "a")], num_sequences=20) == [["a"]]


def test_a_burst_split_by_slow_arrivals_still_teaches_its_whole_size():
    # Arrivals 50 ms apart outlast the 10 ms gap, so the first burst starts piece by piece,
    # but it is one burst of three (less than max_hold_s apart): the next one waits for three.
    coalescer = SampleCoalescer(0.01, max_hold_s=10.0)
    first, second = Client(), Client()
    assert run_burst(coalescer, [(first, name) for name in "abc"], pause_s=0.05) == [
        ["a"],
        ["b"],
        ["c"],
    ]
    groups = run_burst(coalescer, [(second, name) for name in "abc"], pause_s=0.05)
    assert groups == [["a", "b", "c"]]


def test_compute_threads_below_one_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="compute_threads"):
        TemperServer.Config(model=str(tmp_path), compute_threads=0)


def test_window_longer_than_the_hold_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="sample_window_s"):
        TemperServer.Config(model=str(tmp_path), sample_window_s=0.1, sample_max_hold_s=0.05)


class BatchingClient(Client):
    """A client with `batch()`, like the in-process SamplingClient: records which starts ran
    inside one block."""

    def __init__(self) -> None:
        self.blocks: list[list[str]] = []
        self.open: list[str] | None = None

    def batch(self):
        client = self

        class Block:
            def __enter__(self):
                client.open = []

            def __exit__(self, *exc):
                client.blocks.append(client.open)
                client.open = None

        return Block()


def test_a_start_runs_inside_the_clients_batch_block():
    client = BatchingClient()
    coalescer = SampleCoalescer(0.01, max_hold_s=1.0)
    names = []

    async def main() -> None:
        started = asyncio.Event()

        def start(name: str):
            def run() -> None:
                assert client.open is not None, "started outside the client's batch block"
                client.open.append(name)
                names.append(name)
                if len(names) == 3:
                    started.set()

            return run

        for name in "abc":
            coalescer.add(client, start(name), lineage="policy")
        await asyncio.wait_for(started.wait(), timeout=30)

    asyncio.run(main())
    assert client.blocks == [["a", "b", "c"]]
