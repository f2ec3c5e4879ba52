"""Worker threads: a pinned thread count survives later changes of the default, and a worker
runs on its creator's CUDA device."""

from __future__ import annotations

import threading

import torch

from temper.api.futures import Worker
from temper.api.threads import ThreadSettings, pin_thread_count


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


class _FakeCuda:
    """torch.cuda's per-thread current device, on a machine without a GPU."""

    def __init__(self) -> None:
        self.local = threading.local()

    def current_device(self) -> int:
        return getattr(self.local, "device", 0)

    def set_device(self, device: int) -> None:
        self.local.device = device


def test_a_worker_runs_on_its_creators_cuda_device(monkeypatch):
    """Rank 1 set cuda:1 on its main thread: its training worker's kernels go to cuda:1, not
    to the cuda:0 a new thread starts on."""
    fake = _FakeCuda()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", fake.current_device)
    monkeypatch.setattr(torch.cuda, "set_device", fake.set_device)
    fake.set_device(1)
    worker = Worker("test-device")
    assert worker.submit(fake.current_device).result() == 1
    plain = threading.Thread(target=lambda: seen.append(fake.current_device()))
    seen: list[int] = []
    plain.start()
    plain.join()
    assert seen == [0]  # what a thread without the settings would use


def test_a_worker_does_not_start_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert ThreadSettings.of_caller().cuda_device is None
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    Worker("test-no-cuda").submit(lambda: None).result()
    assert calls == []
