"""Worker: one thread running calls in order, with a thread count that does not depend on
what other threads do meanwhile."""

from __future__ import annotations

import threading

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
