"""Multi-turn rollouts: concurrent episodes against a naive one-turn-at-a-time loop, and the
prefix cache on against off.

The guessing game (temper/rl/envs/guess_number.py) on the tiny Qwen3 after a short supervised
warm-up on binary-search demonstrations (so episodes last several turns, as in RL), on one
engine in this process (one thread). Three ways to play the same 64 episodes (same seeds):
- concurrent: the episode runner (temper/rl/episodes.py) with all 64 in flight, each next turn
  requested as soon as its env step returns, so the live episodes' turns decode together;
- concurrent_no_prefix_cache: the same with the engine's prefix cache off, so every turn
  prefills the whole conversation again (temper/sampler/prefix_cache.py);
- naive: one episode at a time, one turn at a time (the runner on a single episode).
For each: episodes/s (median of `--repeats` runs), prompt tokens prefilled per episode, decode
steps, mean rows per decode step and generator utilization = the share of decode steps whose
batch held every episode still live at the start of the run (64 for the concurrent cases, 1
for the naive one). Prints one JSON line with `speedup` (concurrent over naive) and
`prefix_cache_speedup` (concurrent over concurrent_no_prefix_cache).

    OMP_WAIT_POLICY=PASSIVE python bench/multiturn.py [--episodes 64 --repeats 3]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time

from temper.api.types import SamplingParams
from temper.client.service_client import ServiceClient
from temper.rl.envs import GuessNumber
from temper.rl.episodes import EpisodeRunner
from temper.rl.warmup import SFTWarmup
from temper.sampler.cpu.decoding import CpuDecoding
from temper.sampler.engine import SamplerEngine


class DecodeCounter:
    """Counts the rows of every decode step of an engine and the prompt tokens it prefills
    (wraps its step and prefill functions)."""

    def __init__(self, engine) -> None:
        self.rows: list[int] = []
        self.prefilled = 0
        step = engine._decode_step  # a benchmark may look inside; the library never does
        prefill = engine.admission._prefill

        def counted(decoder) -> None:
            self.rows.append(engine.slots.num_active)
            step(decoder)

        def counted_prefill(rows) -> None:
            self.prefilled += sum(
                len(state.prompt) - (c.length if c else 0) for state, _, c in rows
            )
            prefill(rows)

        engine._decode_step = counted
        engine.admission._prefill = counted_prefill


def play(runner, sampler, groups, *, seeds) -> float:
    start = time.perf_counter()
    runner.start(sampler, groups, params=PARAMS, seeds=seeds).wait()
    return time.perf_counter() - start


PARAMS = SamplingParams(max_tokens=4, temperature=1.0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup-steps", type=int, default=60)
    args = parser.parse_args()
    sampler_config = SamplerEngine.Config(
        max_batch=args.episodes,
        max_seq_len=64,
        cpu=CpuDecoding.Config(num_threads=1, processes=1),
    )
    with tempfile.TemporaryDirectory() as storage:
        service = ServiceClient(storage_dir=storage, sampler=sampler_config)
        training = service.create_training_client("tiny")
        source = GuessNumber.Config().build(tokenizer=training.get_tokenizer())
        SFTWarmup.Config(
            steps=args.warmup_steps, batch_size=32, eval_every=0
        ).build().run_demonstrations(
            training,
            demonstrate=source.demonstration,
            rng=random.Random(0),
            on_step=lambda *_: None,
        )
        sampler = training.save_weights_and_get_sampling_client()
        counter = DecodeCounter(sampler.generator)
        cache_bytes = sampler.generator.prefix_cache.max_bytes
        runner = EpisodeRunner.Config(max_turns=8, max_context=64).build()
        rng = random.Random(1)

        def envs() -> list:
            return [
                source.make_group(rng, split="train", group_size=1)[0] for _ in range(args.episodes)
            ]

        seeds = list(range(args.episodes))  # one an episode: each is a group of its own

        def groups() -> list:
            return [[env] for env in envs()]

        play(runner, sampler, groups(), seeds=seeds)  # warm up
        results = {}
        cache = sampler.generator.prefix_cache
        for name in ("concurrent", "concurrent_no_prefix_cache", "naive"):
            times, counter.rows, counter.prefilled = [], [], 0
            cache.max_bytes = 0 if name == "concurrent_no_prefix_cache" else cache_bytes
            for _ in range(args.repeats):
                if name.startswith("concurrent"):
                    times.append(play(runner, sampler, groups(), seeds=seeds))
                else:
                    times.append(sum(play(runner, sampler, [[env]], seeds=[seed])
                                     for env, seed in zip(envs(), seeds, strict=True)))  # fmt: skip
            full = args.episodes if name.startswith("concurrent") else 1
            results[name] = {
                "episodes_per_s": args.episodes / statistics.median(times),
                "prefilled_tokens_per_episode": counter.prefilled / args.repeats / args.episodes,
                "decode_steps": len(counter.rows) / args.repeats,
                "mean_rows_per_decode_step": statistics.mean(counter.rows),
                "generator_utilization": sum(r == full for r in counter.rows) / len(counter.rows),
            }
        runner.close()
    rate = {name: result["episodes_per_s"] for name, result in results.items()}
    print(json.dumps({
        "bench": "multiturn", "episodes": args.episodes, **results,
        "speedup": rate["concurrent"] / rate["naive"],
        "prefix_cache_speedup": rate["concurrent"] / rate["concurrent_no_prefix_cache"],
    }))  # fmt: skip


if __name__ == "__main__":
    main()
