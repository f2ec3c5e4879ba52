"""The `temper` command line: `temper COMMAND [ARGS...]`.

Subcommands are listed by `commands()`, built on each call rather than kept in a module-level
table. A new command is one entry there: usually `function_command(fn, name=...)`, which turns
the documented keyword-only parameters of `fn` into flags with tyro. `train` and `plan` are
special: their flags come from the chosen recipe's config (see temper/config/cli.py).

Every command returns an exit code; `main` never calls sys.exit, so tests call it in-process.
Usage errors exit with code 2, as tyro's do.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import pathlib
import shutil
import sys
import textwrap
from collections.abc import Callable, Sequence
from typing import Any

import tyro

from temper.checkpoint.run_state import has_run_state
from temper.commands import model_dir, plan, plot
from temper.commands import sample as sample_command
from temper.commands import serve as serve_command
from temper.commands import users as users_command
from temper.config import cli as config_cli
from temper.config import recipes, serialize
from temper.config.configurable import missing_packages
from temper.distributed import launch
from temper.distributed.placement import Placement
from temper.distributed.ranks import Ranks
from temper.job import ModelChoice


@dataclasses.dataclass(frozen=True)
class Command:
    """A subcommand: a one-line description and a function from its argv to an exit code."""

    description: str
    run: Callable[[list[str]], int]


def commands(*, recipe_package: str = recipes.RECIPES_PACKAGE) -> dict[str, Command]:
    """The subcommands of `temper`, by name."""
    return {
        "train": Command(
            description="Train from a recipe; flags override fields of its config.",
            run=functools.partial(train, package=recipe_package),
        ),
        "recipes": Command(
            description="List the registered recipes.",
            run=functools.partial(show_recipes, package=recipe_package),
        ),
        "init-model": function_command(model_dir.init_model, name="init-model"),
        "plan": Command(
            description="Print the GPU memory each rank of a recipe's RL job would hold, and "
            "whether it fits; flags override the recipe's fields as in `train`.",
            run=functools.partial(plan_memory, package=recipe_package),
        ),
        "plot": function_command(plot.plot, name="plot"),
        "sample": function_command(sample_command.sample, name="sample"),
        "serve": Command(
            description="Serve a model over the Tinker HTTP API (needs the server extra).",
            run=serve_command.serve,
        ),
        "users": function_command(users_command.users, name="users"),
    }


def function_command(fn: Callable[..., int | None], *, name: str) -> Command:
    """A command whose flags are `fn`'s parameters, described by its docstring's first
    paragraph."""
    description = " ".join((fn.__doc__ or "").strip().split("\n\n", 1)[0].split())
    return Command(description=description, run=functools.partial(run_function, fn, name=name))


def run_function(fn: Callable[..., int | None], argv: Sequence[str], *, name: str) -> int:
    """Parse `argv` into `fn`'s parameters with tyro, call it and return its exit code."""
    try:
        result = tyro.cli(fn, args=list(argv), prog=f"temper {name}")
    except SystemExit as exit_:
        return _exit_code(exit_)
    except (ValueError, FileNotFoundError, FileExistsError) as error:
        # Bad user input (a missing directory, an unknown size): a message, not a traceback.
        print(f"temper {name}: error: {error}", file=sys.stderr)
        return 2
    return 0 if result is None else int(result)


def train(argv: Sequence[str], *, package: str = recipes.RECIPES_PACKAGE) -> int:
    """`temper train`: resolve the config, create the run dir, save config.json, build, run."""
    try:
        invocation = config_cli.parse_train_argv(argv, prog="temper train", package=package)
        if launch.launched_by_torchrun():
            return _train_on_ranks(invocation)
        if invocation.nproc is not None:
            _check_runs_on_ranks(invocation)
            _check_world_size(invocation)
        missing = missing_packages(invocation.config)
        if missing:  # found now, not at the setting's first use far into the run
            raise ValueError("; ".join(missing))
        _check_model(invocation)
        # On several nodes rank 0 prepares it under torchrun (the others find it there).
        if not invocation.resume and invocation.nnodes == 1:
            config_cli.prepare_run_dir(
                invocation.run_dir, resumable=has_run_state(invocation.run_dir)
            )
    except SystemExit as exit_:
        return _exit_code(exit_)
    except ValueError as error:
        print(f"temper train: error: {error}", file=sys.stderr)
        return 2
    if invocation.nproc is not None:
        # The ranks get this run dir (a default one is named by the time, which they would
        # not agree on) and no launch options.
        args = list(argv)
        for flag in config_cli.LAUNCH_OPTIONS:
            args = config_cli.without_option(args, flag)
        if not invocation.resume:
            args = [
                *config_cli.without_option(args, "--run-dir"),
                "--run-dir",
                str(invocation.run_dir),
            ]
        try:
            code = launch.run_under_torchrun(
                nproc=invocation.nproc,
                nnodes=invocation.nnodes,
                rdzv_endpoint=invocation.rdzv_endpoint,
                run_id=invocation.run_dir.name,
                args=["train", *args],
            )
        except KeyboardInterrupt:
            return _interrupted(invocation.run_dir, nproc=invocation.nproc)
        if code != 0 and not invocation.resume and invocation.nnodes == 1:
            _remove_if_only_config(invocation.run_dir)
        if code != 0 and invocation.nnodes == 1 and has_run_state(invocation.run_dir):
            # torchrun stops the other ranks as soon as one fails, often before they could
            # say so: the way on is said here, once.
            print(
                f"temper train: a rank failed (torchrun's report above); `temper train --resume "
                f"{invocation.run_dir} --nproc {invocation.nproc}` continues from the run's last "
                "full-state checkpoint",
                file=sys.stderr,
            )
        return code
    config_path = invocation.run_dir / "config.json"
    if invocation.resume:
        return _resume(invocation)
    serialize.save_config(config_path, invocation.config, recipe=invocation.recipe)
    try:
        job: config_cli.Job = invocation.config.build()
        job.run(run_dir=invocation.run_dir)
    except (ValueError, FileNotFoundError) as error:
        # Bad input found while building (a missing model directory, an unknown size): say
        # so plainly, and do not leave behind a run directory that holds nothing but its config.
        print(f"temper train: error: {error}", file=sys.stderr)
        _remove_if_only_config(invocation.run_dir)
        return 1
    except KeyboardInterrupt:
        return _interrupted(invocation.run_dir)
    return 0


def plan_memory(argv: Sequence[str], *, package: str = recipes.RECIPES_PACKAGE) -> int:
    """`temper plan`: a recipe's memory plan (commands/plan.py); bad input exits with 2."""
    try:
        return plan.plan(argv, package=package)
    except SystemExit as exit_:
        return _exit_code(exit_)
    except (ValueError, FileNotFoundError) as error:
        print(f"temper plan: error: {error}", file=sys.stderr)
        return 2


def _interrupted(run_dir: pathlib.Path, *, nproc: int | None = None) -> int:
    """Ctrl-C during a run: how to continue it (when it can be) instead of a traceback; 130
    as shells use."""
    if has_run_state(run_dir):
        on_ranks = "" if nproc is None else f" --nproc {nproc}"
        advice = (
            f"`temper train --resume {run_dir}{on_ranks}` continues from the run's last full-state "
            "checkpoint (saved every `checkpoint_every` steps)"
        )
    else:
        advice = (
            "no full-state checkpoint was saved yet, so there is nothing to resume; start "
            "again with another --run-dir (with --checkpoint_every N, a run can be resumed)"
        )
    print(f"\ntemper train: interrupted; {advice}", file=sys.stderr)
    return 130


def _remove_if_only_config(run_dir: pathlib.Path) -> None:
    """Remove a run directory that a failed start left with nothing trained in it: empty, or
    holding only config.json and the run records (`checkpoints/<run>/run.json`) its training
    clients claimed before the error."""
    if not run_dir.is_dir():
        return
    files = [path.relative_to(run_dir) for path in run_dir.rglob("*") if not path.is_dir()]
    started = [
        path
        for path in files
        if path != pathlib.Path("config.json")
        and not (
            len(path.parts) == 3 and path.parts[0] == "checkpoints" and path.name == "run.json"
        )
    ]
    if not started:
        shutil.rmtree(run_dir)


def _check_runs_on_ranks(invocation: config_cli.TrainInvocation) -> None:
    job_class = type(invocation.config)._owner
    if not getattr(job_class, "runs_on_ranks", False):
        raise ValueError(f"{job_class.__qualname__} runs in one process only (no --nproc/torchrun)")


def _check_world_size(invocation: config_cli.TrainInvocation) -> None:
    """`--nproc N`: settings that cannot fit N x nnodes ranks fail here, in a second, instead
    of on every rank after torchrun has started them."""
    check_ranks = getattr(invocation.config.build(), "check_ranks", None)
    if check_ranks is not None:
        check_ranks(world_size=invocation.nproc * invocation.nnodes)


def _check_model(invocation: config_cli.TrainInvocation) -> None:
    """Settings the job refuses for its model on this machine (a generator backend that
    cannot run it), from the model's config alone: before the run directory is written."""
    check_model = getattr(invocation.config.build(), "check_model", None)
    if check_model is not None:
        check_model()


def _train_on_ranks(invocation: config_cli.TrainInvocation) -> int:
    """`temper train` on one rank of a torchrun job: every rank builds and runs the job; rank 0
    prepares the run dir and writes config.json. Errors are reported on every rank."""
    if invocation.nproc is not None:
        raise ValueError("--nproc starts torchrun; under torchrun the ranks are torchrun's")
    _check_runs_on_ranks(invocation)
    # NCCL and one GPU per rank for a job on 'cuda', gloo on CPU.
    model = getattr(invocation.config, "model", None)
    device = model.device if isinstance(model, ModelChoice.Config) else "cpu"
    placement = getattr(invocation.config, "placement", None)
    # A colocated run's weight syncs are the default group's gathers: the placement's deadlines
    # bound them as they bound a disaggregated run's transfers.
    timeout_s = None
    if isinstance(placement, Placement.Config):
        timeout_s = max(placement.sync_timeout_s, placement.call_timeout_s)
    rank = launch.init_from_env(
        device_type="cuda" if device.startswith("cuda") else "cpu", timeout_s=timeout_s
    )
    prepared = False
    try:
        ranks = Ranks.of_default_group()
        run_dir = ranks.broadcast(invocation.run_dir)
        _check_model(invocation)  # every rank alike, before rank 0 writes the run directory

        def prepare() -> None:
            if not invocation.resume:
                config_cli.prepare_run_dir(run_dir, resumable=has_run_state(run_dir))
                config_path = run_dir / "config.json"
                serialize.save_config(config_path, invocation.config, recipe=invocation.recipe)

        ranks.on_writer(prepare)
        prepared = not invocation.resume
        job = invocation.config.build()
        if invocation.resume:
            job.run(run_dir=run_dir, resume=True)
        else:
            job.run(run_dir=run_dir)
        del job
    except (ValueError, FileNotFoundError) as error:
        print(f"temper train: error (rank {rank.rank}): {error}", file=sys.stderr)
        if rank.rank == 0 and prepared:
            _remove_if_only_config(run_dir)
        return 1
    finally:
        launch.shutdown()
    return 0


def _resume(invocation: config_cli.TrainInvocation) -> int:
    """`temper train --resume RUN_DIR`: jobs that can resume take `run(..., resume=True)`."""
    job = invocation.config.build()
    if "resume" not in inspect.signature(job.run).parameters:
        print(
            f"temper train: error: --resume: {type(job).__qualname__} cannot resume a run yet",
            file=sys.stderr,
        )
        return 2
    try:
        job.run(run_dir=invocation.run_dir, resume=True)
    except (ValueError, FileNotFoundError) as error:
        print(f"temper train: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return _interrupted(invocation.run_dir)
    return 0


def show_recipes(argv: Sequence[str], *, package: str = recipes.RECIPES_PACKAGE) -> int:
    """`temper recipes`: a table of recipe names and descriptions."""

    def list_recipes() -> None:
        """List the registered recipes (run one with `temper train NAME`)."""
        import rich.console
        import rich.table

        table = rich.table.Table("name", "description")
        for info in recipes.list_recipes(package=package):
            table.add_row(info.name, info.description + (" (default)" if info.default else ""))
        rich.console.Console().print(table)

    try:
        return run_function(list_recipes, argv, name="recipes")
    except ValueError as error:
        print(f"temper recipes: error: {error}", file=sys.stderr)
        return 2


def main(
    argv: Sequence[str] | None = None, *, recipe_package: str = recipes.RECIPES_PACKAGE
) -> int:
    """Run `temper` with `argv` (default: sys.argv[1:]) and return the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    table = commands(recipe_package=recipe_package)
    if not args or args[0] in ("-h", "--help"):
        print(_usage(table), file=sys.stdout if args else sys.stderr)
        return 0 if args else 2
    command = table.get(args[0])
    if command is None:
        close = difflib.get_close_matches(args[0], list(table), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        print(
            f"temper: unknown command {args[0]!r}{hint}; valid commands: {', '.join(table)}",
            file=sys.stderr,
        )
        return 2
    return command.run(args[1:])


def _usage(table: dict[str, Command]) -> str:
    width = max(len(name) for name in table)
    lines = [
        textwrap.fill(
            command.description,
            width=96,
            initial_indent=f"  {name.ljust(width)}  ",
            subsequent_indent=" " * (width + 4),
        )
        for name, command in table.items()
    ]
    return (
        "usage: temper COMMAND [ARGS...]\n\ncommands:\n"
        + "\n".join(lines)
        + "\n\nRun `temper COMMAND --help` for the options of a command."
    )


def _exit_code(exit_: SystemExit) -> int:
    code: Any = exit_.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)  # sys.exit("message") prints the message and exits with 1
    return 1
