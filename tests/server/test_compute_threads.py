"""--compute-threads on CPU: the torch threads the server computes on, and the sampler's
helper processes ('auto': a core each) kept within them, so the event loop keeps its core."""

from __future__ import annotations

from dataclasses import replace

import torch

from temper.sampler.cpu.decoding import CpuDecoding
from temper.sampler.engine import SamplerEngine
from temper.server.state.server import TemperServer


def test_sampler_processes_stay_within_the_compute_threads(model_dir, tmp_path):
    previous = torch.get_num_threads()
    cores = CpuDecoding.Config().num_processes()
    try:
        for threads in (1, 2):
            config = TemperServer.Config(
                model=[str(model_dir)], storage=str(tmp_path / "storage"), compute_threads=threads
            )
            server = TemperServer(config)
            assert torch.get_num_threads() == threads
            assert server.backend.sampler_config.cpu.processes == min(threads, cores)
            # An explicit count is the user's choice, kept as given.
            three = SamplerEngine.Config(cpu=CpuDecoding.Config(processes=3))
            server = TemperServer(replace(config, sampler=three))
            assert server.backend.sampler_config.cpu.processes == 3
    finally:
        torch.set_num_threads(previous)
