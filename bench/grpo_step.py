"""Seconds per GRPO step: Temper's client API (as the RL loop drives it) against TRL's GRPOTrainer.

One step = 16 prompts x 8 samples x 8 new tokens on the tiny random Qwen3 (4 layers, width 128,
the built-in digits vocabulary), then one PPO-loss forward_backward + AdamW optim_step on all
128 completions. No stop token (Temper `stop=[]`, TRL `min_new_tokens=8`), so every completion
is exactly 8 tokens on both sides. Both load the same model directory (one random checkpoint
saved once), and TRL runs without a reference model (beta 0), as Temper's loop does.

Temper's step is the RL loop's: `save_weights_and_get_sampling_client`, `make_groups` and
`rollout_groups` (the "sample" phase), then group advantages, `policy_datum`,
`forward_backward("ppo")` and `optim_step` ("train"). TRL's "sample" phase is its
`_generate_and_score_completions` (generate, decode, reward, advantages). Medians over
`--steps` steps after `--warmup` steps, in `--rounds` rounds that alternate which side runs
first; the speedup is the median of the rounds' ratios. Prints one JSON line. Without `trl`
installed (the `bench` extra), only Temper's numbers are printed, with the reason.

    OMP_WAIT_POLICY=PASSIVE python bench/grpo_step.py [--steps 10 --rounds 3]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from temper.api import AdamParams, SamplingParams
from temper.checkpoint.hf import save_pretrained
from temper.checkpoint.model_source import ModelSource
from temper.client.service_client import ServiceClient
from temper.config.recipes import default_recipe
from temper.rl.advantages import group_advantages
from temper.rl.env import make_groups
from temper.rl.rollout import policy_datum, rollout_groups
from temper.tasks import SumDigits

PROMPTS = 16
GROUP_SIZE = 8
NEW_TOKENS = 8
LEARNING_RATE = 2e-4


def temper_steps(model_dir: Path, *, steps: int, warmup: int) -> dict[str, list[float]]:
    """Seconds of the sample and train phases and of whole steps, per timed step."""
    with tempfile.TemporaryDirectory() as storage:
        # The default recipe's engines (sampler, trainer), as `make demo` runs them.
        job = default_recipe().fn()
        service = ServiceClient(storage_dir=storage, sampler=job.sampler, trainer=job.trainer)
        training = service.create_training_client(str(model_dir))
        tokenizer, task = training.get_tokenizer(), SumDigits.Config().build()
        rng = random.Random(0)
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, stop=[])
        adam = AdamParams(learning_rate=LEARNING_RATE, beta2=0.95, grad_clip_norm=1.0)
        times: dict[str, list[float]] = {"sample": [], "train": [], "total": []}
        for step in range(warmup + steps):
            started = time.perf_counter()
            sampler = training.save_weights_and_get_sampling_client()
            groups = make_groups(
                task,
                tokenizer=tokenizer,
                rng=rng,
                num_groups=PROMPTS,
                group_size=GROUP_SIZE,
                split="train",
            )
            trajectories = rollout_groups(sampler, groups, params=params, rng=rng)
            # As the RL loop does: no client holds this version while the trainer steps, so
            # optim_step changes the weights in place instead of copying them for the client.
            del sampler
            sampled = time.perf_counter()
            assert all(len(t.completion) == NEW_TOKENS for g in trajectories for t in g)
            num_tokens = PROMPTS * GROUP_SIZE * NEW_TOKENS
            data = [
                policy_datum(trajectory, advantage=advantage / num_tokens)
                for group in trajectories
                for trajectory, advantage in zip(
                    group, group_advantages([t.reward for t in group], mode="grpo"), strict=True
                )
            ]
            training.forward_backward(data, "ppo").result()
            training.optim_step(adam).result()
            done = time.perf_counter()
            if step >= warmup:
                times["sample"].append(sampled - started)
                times["train"].append(done - sampled)
                times["total"].append(done - started)
    return times


def trl_steps(model_dir: Path, *, steps: int, warmup: int) -> dict[str, list[float]]:
    """The same measurement for TRL's GRPOTrainer (transformers generate on CPU)."""
    import datasets
    import transformers
    from trl import GRPOConfig, GRPOTrainer

    task = SumDigits.Config().build()
    rng = random.Random(0)
    problems = [task.sample(rng, split="train") for _ in range(PROMPTS * (warmup + steps))]
    dataset = datasets.Dataset.from_list(
        [{"prompt": p.prompt, "answer": p.answer} for p in problems]
    )

    def exact_match(completions: list[str], answer: list[str], **_: object) -> list[float]:
        return [float(c.strip() == a) for c, a in zip(completions, answer, strict=True)]

    step_times: list[float] = []
    sample_times: list[float] = []

    class StepTimer(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            step_times.append(time.perf_counter() - self.started)

    with tempfile.TemporaryDirectory() as output_dir:
        config = GRPOConfig(
            output_dir=output_dir,
            per_device_train_batch_size=PROMPTS * GROUP_SIZE,  # completions, not prompts
            num_generations=GROUP_SIZE,
            max_completion_length=NEW_TOKENS,
            generation_kwargs={"min_new_tokens": NEW_TOKENS},
            temperature=1.0,
            learning_rate=LEARNING_RATE,
            adam_beta2=0.95,
            max_grad_norm=1.0,
            beta=0.0,
            max_steps=warmup + steps,
            use_cpu=True,
            report_to="none",
            save_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
            seed=0,
        )
        trainer = GRPOTrainer(
            model=transformers.Qwen3ForCausalLM.from_pretrained(model_dir),
            processing_class=transformers.AutoTokenizer.from_pretrained(model_dir),
            reward_funcs=exact_match,
            args=config,
            train_dataset=dataset,
            callbacks=[StepTimer()],
        )
        trainer.remove_callback(transformers.PrinterCallback)  # stdout is one JSON line
        generate_and_score = trainer._generate_and_score_completions

        def timed_generate_and_score(*args, **kwargs):
            started = time.perf_counter()
            result = generate_and_score(*args, **kwargs)
            sample_times.append(time.perf_counter() - started)
            assert result["completion_ids"].shape[1] == NEW_TOKENS
            return result

        trainer._generate_and_score_completions = timed_generate_and_score
        trainer.train()
    assert len(step_times) == len(sample_times) == warmup + steps
    step_s, sample_s = step_times[warmup:], sample_times[warmup:]
    return {
        "sample": sample_s,
        "train": [t - s for t, s in zip(step_s, sample_s, strict=True)],
        "total": step_s,
    }


def medians(times: dict[str, list[float]]) -> dict[str, float]:
    return {f"{name}_s": round(statistics.median(values), 4) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    report: dict[str, object] = {
        "bench": "grpo_step",
        "model": "tiny",
        "prompts": PROMPTS,
        "group_size": GROUP_SIZE,
        "new_tokens": NEW_TOKENS,
        "threads": torch.get_num_threads(),
        "rounds": args.rounds,
    }
    try:
        import trl
    except ImportError as error:
        trl = None
        report["trl_skipped"] = f"{error}; pip install -e '.[bench]' to compare with TRL"
    temper: dict[str, list[float]] = {"sample": [], "train": [], "total": []}
    baseline: dict[str, list[float]] = {"sample": [], "train": [], "total": []}
    ratios = []
    with tempfile.TemporaryDirectory() as directory:
        base = ModelSource.Config(size="tiny", tokenizer="digits", seed=0).build()
        model_dir = save_pretrained(base.model, Path(directory) / "model", tokenizer=base.tokenizer)
        # Rounds alternate which side runs first, and each round's ratio compares steps timed
        # seconds apart, so the machine's drift (a shared VM) does not favour either side.
        for round_index in range(args.rounds):
            runners = [("temper", temper_steps), ("trl", trl_steps)]
            if trl is None:
                runners = runners[:1]
            elif round_index % 2:
                runners.reverse()
            this_round = {}
            for name, run in runners:
                this_round[name] = run(model_dir, steps=args.steps, warmup=args.warmup)
            for phase, values in this_round["temper"].items():
                temper[phase] += values
            if trl is not None:
                for phase, values in this_round["trl"].items():
                    baseline[phase] += values
                ratios.append(
                    statistics.median(this_round["trl"]["total"])
                    / statistics.median(this_round["temper"]["total"])
                )
    report["temper"] = medians(temper)
    if trl is not None:
        report["trl_version"] = trl.__version__
        report["trl"] = medians(baseline)
        report["speedup_per_round"] = [round(r, 2) for r in ratios]
        report["speedup_vs_trl"] = round(statistics.median(ratios), 2)
    else:
        report["trl"] = None
    print(json.dumps(report))


if __name__ == "__main__":
    main()
