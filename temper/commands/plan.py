"""`temper plan RECIPE`: the planned GPU memory of a recipe's RL job per rank, computed
without running it (`temper plan serve ...`: a server's, plan_serve.py).

Its settings come from the recipe's config, with the field overrides and launch options
`temper train` takes; two options of its own describe the GPU, which the job would measure.
What is counted and what is assumed is written in temper/job/memory_plan.py.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from temper.config import cli as config_cli
from temper.config import recipes
from temper.job.memory_plan import PlanSettings
from temper.job.memory_report import plan_text

PLAN_USAGE = """\
Print the memory each rank of a recipe's RL job would hold on its GPU (trainer shard, generator
weights, KV cache, weight-sync buffers, activations) and whether it fits; nothing runs. The
options below override the recipe's fields, as in `temper train`.

  temper plan [RECIPE] [--nproc N] [--nnodes N] [--gpu-memory-gib G] [--headroom H]
      [--FIELD VALUE ...]

  RECIPE              a name from `temper recipes`, module:function or path/to/file.py:function
                      (default: the recipe marked default)
  --nproc N           ranks per machine (default 1); --nproc-per-node is the same
  --nnodes N          machines (default 1)
  --gpu-memory-gib G  memory of one GPU in GiB (default 80; an '80 GB' GPU reports about 79)
  --headroom H        share of it kept free for what the plan does not count: scratch and
                      fragmentation (default 0.05)

`temper plan serve [SERVE FLAGS] [--nproc N] [--lora-rank R]` instead prints what each rank of
`temper serve` holds per served model, by the estimates its model memory budget counts.

--model.base_model takes a model directory or a named size: a HF repo id (Qwen/Qwen3-8B,
meta-llama/Llama-3.1-8B, Qwen/Qwen3-30B-A3B), FAMILY/SIZE (llama/8B) or a Qwen3 size (8B).
Exit status: 0 when the plan fits, 1 when it does not, 2 for bad input."""

_OPTIONS = ("--nproc", "--nproc-per-node", "--nnodes", "--gpu-memory-gib", "--headroom")


def plan(argv: Sequence[str], *, package: str = recipes.RECIPES_PACKAGE) -> int:
    """Print the memory plan of the recipe's job that `argv` names; 0 when it fits, 1 when it
    does not. Raises ValueError for a bad recipe or setting, SystemExit (tyro) for `--help`
    and bad overrides."""
    args = list(argv)
    if args[:1] == ["serve"]:
        from temper.commands.plan_serve import plan_serve

        return plan_serve(args[1:])
    recipe_arg = args.pop(0) if args and not args[0].startswith("-") else None
    options, overrides = config_cli.split_options(args, names=_OPTIONS)
    nproc, per_node = options.get("--nproc"), options.get("--nproc-per-node")
    if nproc is not None and per_node is not None and nproc != per_node:
        raise ValueError(f"--nproc {nproc} and --nproc-per-node {per_node}: give one of them")
    flag = "--nproc" if nproc is not None else "--nproc-per-node"
    nproc_per_node = config_cli.count_option(nproc or per_node, flag=flag) or 1
    nnodes = config_cli.count_option(options.get("--nnodes"), flag="--nnodes") or 1
    gpu_memory_gib = _number(options, "--gpu-memory-gib", default=PlanSettings.gpu_memory_gib)
    headroom = _number(options, "--headroom", default=PlanSettings.headroom)
    recipe, config = config_cli.recipe_config(
        recipe_arg, overrides=overrides, prog="temper plan", package=package, usage=PLAN_USAGE
    )
    job = config.build()
    memory_plan = getattr(job, "memory_plan", None)
    if memory_plan is None:
        raise ValueError(
            f"recipe {recipe!r} builds {type(job).__qualname__}, which has no memory plan; "
            "`temper plan` plans RL jobs (recipes that return an RLJob.Config)"
        )
    planned = memory_plan(
        nproc_per_node=nproc_per_node,
        nnodes=nnodes,
        gpu_memory_gib=gpu_memory_gib,
        headroom=headroom,
    )
    print(plan_text(planned))
    # Scripts can test the verdict without parsing it.
    return 0 if planned.fits else 1


def _number(options: dict[str, str], flag: str, *, default: float) -> float:
    value = options.get(flag)
    if value is None:
        return default
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not math.isfinite(number):
        raise ValueError(f"{flag} {value}: give a number")
    return number
