"""Sampling with and without the prefix cache when prompts share a system prompt.

Each call sends `--requests` requests (one sample each) whose prompts are one shared system
prompt (`--system-tokens`) plus a few tokens of their own, `--calls` calls in a row on one
engine, as a server answering many users of one base model would see them. With the cache
the first call prefills every prompt whole; later calls copy the system prompt's whole
16-token blocks from the first call's finished sequences and prefill only the rest. The same
work runs on an engine without the cache (`prefix_cache_mib=0`), in rounds that alternate
the order; both engines empty their cache before each round. Tiny model, fp32, one process
on one thread. Prints one JSON line: the medians, prompt tokens prefilled per call, and the
config of both sides.

    OMP_WAIT_POLICY=PASSIVE python bench/prefix_cache.py [--calls 10 --requests 16]
"""

from __future__ import annotations

import argparse
import json
import os
import random

import torch
from timing import interleaved_median_seconds

from temper.api import SamplingParams
from temper.models import materialize, qwen3_size
from temper.sampler.cpu.decoding import CpuDecoding
from temper.sampler.engine import SamplerEngine, SampleRequest

VOCAB = 1024
OWN_TOKENS = 8
NEW_TOKENS = 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--calls", type=int, default=10, help="generate calls per round")
    parser.add_argument("--requests", type=int, default=16, help="requests per call")
    parser.add_argument("--system-tokens", type=int, default=96, help="shared prompt length")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds")
    args = parser.parse_args()
    if min(args.calls, args.requests, args.system_tokens, args.repeats) < 1:
        parser.error("--calls, --requests, --system-tokens and --repeats must be >= 1")
    torch.set_num_threads(1)
    model = materialize(qwen3_size("tiny", vocab_size=VOCAB), seed=0, dtype="float32").eval()
    rng = random.Random(0)
    system = [rng.randrange(VOCAB) for _ in range(args.system_tokens)]
    calls = [
        [
            SampleRequest(
                prompt=system + [rng.randrange(VOCAB) for _ in range(OWN_TOKENS)],
                params=SamplingParams(max_tokens=NEW_TOKENS, stop=[], seed=index),
            )
            for index in range(args.requests)
        ]
        for _ in range(args.calls)
    ]
    configs = {
        name: SamplerEngine.Config(
            max_batch=args.requests,
            max_seq_len=args.system_tokens + OWN_TOKENS + NEW_TOKENS,
            prefix_cache_mib=mib,
            cpu=CpuDecoding.Config(num_threads=1, processes=1),
        )
        for name, mib in (("cached", SamplerEngine.Config.prefix_cache_mib), ("uncached", 0.0))
    }
    engines = {name: config.build(model=model) for name, config in configs.items()}

    def run(engine: SamplerEngine):
        def calls_in_a_row() -> None:
            engine.prefix_cache.clear()
            for requests in calls:
                engine.generate(requests)

        return calls_in_a_row

    seconds = interleaved_median_seconds(
        {name: run(engine) for name, engine in engines.items()}, repeats=args.repeats
    )
    cache = engines["cached"].prefix_cache
    hit_tokens_per_round = cache.num_hit_tokens / (args.repeats + 1)  # the warm-up round too
    prompt_tokens = args.calls * args.requests * (args.system_tokens + OWN_TOKENS)
    report = {
        "bench": "prefix_cache",
        "calls": args.calls,
        "requests": args.requests,
        "system_tokens": args.system_tokens,
        "own_tokens": OWN_TOKENS,
        "new_tokens": NEW_TOKENS,
        "load_average": round(os.getloadavg()[0], 2),
        "cached_s": round(seconds["cached"], 4),
        "uncached_s": round(seconds["uncached"], 4),
        "speedup": round(seconds["uncached"] / seconds["cached"], 2),
        "prefilled_tokens_per_call": {
            "cached": round((prompt_tokens - hit_tokens_per_round) / args.calls, 1),
            "uncached": prompt_tokens / args.calls,
        },
        "configs": {name: repr(config) for name, config in configs.items()},
    }
    for engine in engines.values():
        engine.close()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
