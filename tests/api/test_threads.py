"""pin_thread_count: a thread's count stays what it pinned, whatever others set afterwards."""

from __future__ import annotations

import threading

import torch

from temper.api.threads import pin_thread_count


def _count_after_default_changes(pin) -> int:
    """A thread pins 2 with `pin`, another sets the default to 1, then the first runs its
    first torch op: the count that op ran on."""
    pinned, changed = threading.Event(), threading.Event()
    seen: list[int] = []

    def thread() -> None:
        pin(2)
        pinned.set()
        changed.wait()
        torch.ones(2, 2).sum()
        seen.append(torch.get_num_threads())

    previous = torch.get_num_threads()
    worker = threading.Thread(target=thread)
    worker.start()
    pinned.wait()
    try:
        torch.set_num_threads(1)
        changed.set()
        worker.join()
    finally:
        torch.set_num_threads(previous)
    return seen[0]


def test_a_pinned_count_survives_a_later_change_of_the_default():
    assert _count_after_default_changes(pin_thread_count) == 2


def test_set_num_threads_alone_does_not_pin():
    # Why pin_thread_count exists: if torch ever pins on set_num_threads, it can go.
    assert _count_after_default_changes(torch.set_num_threads) == 1
