"""Worker: one thread running calls in order, with a thread count that does not depend on
what other threads do meanwhile."""

from __future__ import annotations

import threading
import time

import torch

from temper.api.futures import Worker


def _set_default_threads_from_another_thread(count: int) -> None:
    thread = threading.Thread(target=torch.set_num_threads, args=(count,))
    thread.start()
    thread.join()


def test_a_worker_keeps_its_creators_thread_count_whatever_others_set_meanwhile():
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        worker = Worker("test-threads")
        # Another thread changes torch's process-wide default before the worker's first op
        # (what a sampler decoding on one thread does for a moment).
        _set_default_threads_from_another_thread(1)
        assert worker.submit(torch.get_num_threads).result() == 2
        worker.close()
        # The same once the worker thread has started but has not run a torch op yet.
        worker = Worker("test-threads-started")
        worker.submit(lambda: None).result()
        _set_default_threads_from_another_thread(1)
        assert worker.submit(torch.get_num_threads).result() == 2
        worker.close()
    finally:
        _set_default_threads_from_another_thread(previous)
        torch.set_num_threads(previous)


def test_calls_run_in_submission_order():
    worker = Worker("test-order")
    seen: list[int] = []
    futures = [worker.submit(seen.append, index) for index in range(20)]
    for future in futures:
        future.result()
    assert seen == list(range(20))
    worker.close()


class _Batches:
    """A `run_batch` that records the batches it ran."""

    def __init__(self) -> None:
        self.seen: list[list[str]] = []

    def __call__(self, items):
        self.seen.append(list(items))
        return [f"{item}!" for item in items]


def test_without_a_block_a_free_worker_may_run_the_first_item_alone():
    # The race `batch()` removes: the worker is free, so the first sample runs before the
    # next is sent (forced here by waiting for it; in a run it depends on scheduling).
    worker, batches = Worker("test-race"), _Batches()
    assert worker.submit_batched("k", "a", batches).result() == "a!"
    futures = [worker.submit_batched("k", item, batches) for item in "bc"]
    assert [future.result() for future in futures] == ["b!", "c!"]
    assert batches.seen == [["a"], ["b", "c"]]
    worker.close()


def test_items_sent_in_a_block_run_as_one_batch_however_slowly_they_arrive():
    worker, batches = Worker("test-block"), _Batches()
    with worker.batch():
        futures = [worker.submit_batched("k", "a", batches)]
        time.sleep(0.2)  # a free worker: without the block, "a" would run alone meanwhile
        assert not futures[0].done() and batches.seen == []
        futures += [worker.submit_batched("k", item, batches) for item in "bc"]
        futures += [worker.submit_batched("other", "d", batches)]
    assert [future.result() for future in futures] == ["a!", "b!", "c!", "d!"]
    assert batches.seen == [["a", "b", "c"], ["d"]]  # one batch per key, in order
    worker.close()


def test_a_block_keeps_the_order_of_calls_and_its_own_batches():
    worker, batches = Worker("test-block-order"), _Batches()
    gate = threading.Event()
    worker.submit(gate.wait)  # a busy worker: everything below waits in its queue
    before = worker.submit_batched("k", "before", batches)
    with worker.batch():
        with worker.batch():  # blocks nest: the outer one's end releases
            inside = [worker.submit_batched("k", "a", batches)]
        inside.append(worker.submit_batched("k", "b", batches))
        # An ordinary call releases what was sent before it, which runs first.
        call = worker.submit(lambda: list(batches.seen))
        inside.append(worker.submit_batched("k", "c", batches))
    after = worker.submit_batched("k", "after", batches)
    gate.set()
    assert [f.result() for f in (before, *inside, after)] == [
        "before!", "a!", "b!", "c!", "after!"
    ]  # fmt: skip
    assert call.result() == [["before"], ["a", "b"]]
    assert batches.seen == [["before"], ["a", "b"], ["c"], ["after"]]
    worker.close()
