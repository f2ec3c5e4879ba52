"""A memory plan (memory_plan.py) for people: tables for `temper plan`, one line per rank for
a job's startup log.

Tables use rich's markdown box (plain ASCII) and never wrap, so the output pastes into docs
as it is.
"""

from __future__ import annotations

import rich.box
import rich.console
import rich.table

from temper.job.plan_types import GIB, MemoryPlan, Role, RolePlan

_PHASE_WORDS = {"training": "while training", "sync": "at weight sync"}


def format_bytes(num_bytes: int) -> str:
    if num_bytes == 0:
        return "0"
    if num_bytes >= GIB:
        return f"{num_bytes / GIB:.2f} GiB"
    if num_bytes >= 2**20:
        return f"{num_bytes / 2**20:.1f} MiB"
    return f"{num_bytes / 2**10:.1f} KiB"


def _count(num: int) -> str:
    """A parameter count: 8.19B, or 2.34M below a billion (a tiny test model)."""
    return f"{num / 1e9:.2f}B" if num >= 1e9 else f"{num / 1e6:.2f}M"


def headline(plan: MemoryPlan) -> str:
    """What the plan is of, in one line."""
    settings = plan.settings
    training = "full" if settings.lora_rank is None else f"LoRA rank {settings.lora_rank}"
    generator = settings.generator_dtype or settings.dtype
    dtypes = settings.dtype if generator == settings.dtype else f"{settings.dtype}/{generator}"
    params = f"{_count(plan.num_params)} parameters"
    if plan.num_active_params != plan.num_params:
        params += f", {_count(plan.num_active_params)} active"
    return (
        f"{plan.model_name} ({params}), {training}, {dtypes}; "
        f"{settings.nnodes} x {settings.nproc_per_node} ranks, {settings.placement}; "
        f"batch {settings.batch} x {settings.max_seq_len} tokens; mode {settings.mode}, "
        f"{settings.weight_sync} weight sync" + ("; KL reference" if settings.kl_reference else "")
    )


def role_table(role: RolePlan) -> rich.table.Table:
    table = rich.table.Table("item", "held", "per rank", box=rich.box.MARKDOWN)
    for row in role.rows:
        table.add_row(row.item, row.phase, format_bytes(row.num_bytes))
    table.add_section()
    table.add_row("steady", "", format_bytes(role.steady_bytes))
    for phase in ("training", "sync"):
        if any(row.phase == phase for row in role.rows):
            table.add_row(f"peak {_PHASE_WORDS[phase]}", "", format_bytes(role.total(phase)))
    return table


def verdict(plan: MemoryPlan) -> str:
    """Whether every role's peak fits a GPU less the headroom, and by how much."""
    settings = plan.settings
    budget = (
        f"{format_bytes(plan.usable_bytes)} usable of a {settings.gpu_memory_gib:g} GiB GPU "
        f"({settings.headroom:.0%} headroom)"
    )
    peaks = "; ".join(
        f"{role.role} peaks at {format_bytes(role.peak_bytes)} {_PHASE_WORDS[role.peak_phase]}"
        for role in plan.roles
    )
    return f"{'fits' if plan.fits else 'DOES NOT FIT'}: {peaks}; {budget}"


_REMEDIES = (
    (
        "activations",
        "--sharding.activation_checkpointing full, or a smaller "
        "--trainer.max_tokens_per_microbatch",
    ),
    ("logits", "a smaller --trainer.max_tokens_per_microbatch"),
    ("KV cache", "a smaller --sampler.max_batch or --sampler.max_seq_len"),
    (
        "generator weights",
        "--placement.mode disaggregated with --placement.generator_ranks and "
        "--placement.generator_tp",
    ),
    ("LoRA merge", "room elsewhere (the merge holds the largest adapted weight in fp32 3 times)"),
    ("weight-sync", "a smaller --placement.bucket_mb"),
)
"""What shrinks a plan's row, by how its item starts (the job's flags, which `temper plan`
takes too). Anything else (weights, moments, gradients, FSDP's gathered blocks) shrinks with
more ranks or LoRA."""
_MORE_RANKS = "more ranks (--nproc, --nnodes)"
_OR_LORA = ", or LoRA (--model.lora_rank)"


def _more_ranks(plan: MemoryPlan) -> str:
    return _MORE_RANKS + ("" if plan.settings.lora_rank is not None else _OR_LORA)


def advice(plan: MemoryPlan) -> list[str]:
    """For each role over the budget: its largest item at its peak, and what shrinks it."""
    lines = []
    for role in plan.roles:
        if role.peak_bytes <= plan.usable_bytes:
            continue
        held = [row for row in role.rows if row.phase in ("always", role.peak_phase)]
        largest = max(held, key=lambda row: row.num_bytes)
        remedy = next((r for prefix, r in _REMEDIES if largest.item.startswith(prefix)), None)
        if largest.item.startswith("generator weights") and role.role == "generator":
            remedy = "a larger --placement.generator_tp (each generator holds 1/tp of them)"
        lines.append(
            f"{role.role}: over by {format_bytes(role.peak_bytes - plan.usable_bytes)}; the "
            f"largest item {_PHASE_WORDS[role.peak_phase]} is {largest.item} "
            f"({format_bytes(largest.num_bytes)}): try {remedy or _more_ranks(plan)}"
        )
    return lines


def plan_text(plan: MemoryPlan) -> str:
    """The headline, a table per role and the verdict (with advice when it does not fit), as
    plain text."""
    parts = [headline(plan)]
    for role in plan.roles:
        parts += ["", f"{role.role}: {role.description}", _rendered(role_table(role))]
    parts += ["", verdict(plan), *advice(plan)]
    return "\n".join(parts)


def _rendered(table: rich.table.Table) -> str:
    """The table's text without the markdown box's blank edges and trailing spaces."""
    console = rich.console.Console(width=200, color_system=None, highlight=False)
    with console.capture() as capture:
        console.print(table)
    lines = (line.rstrip() for line in capture.get().splitlines())
    return "\n".join(line for line in lines if line)


def describe_for_rank(plan: MemoryPlan, *, rank: int, role: Role = "colocated") -> str:
    """One line for rank `rank`'s startup log: its planned bytes, item by item."""
    mine = plan.role(role)
    items = "; ".join(
        f"{row.item} {format_bytes(row.num_bytes)}"
        + ("" if row.phase == "always" else f" ({row.phase})")
        for row in mine.rows
    )
    fits = "fits" if mine.peak_bytes <= plan.usable_bytes else "DOES NOT FIT"
    return (
        f"memory plan, rank {rank} ({role}): steady {format_bytes(mine.steady_bytes)}, peak "
        f"{format_bytes(mine.peak_bytes)} {_PHASE_WORDS[mine.peak_phase]}, "
        f"{format_bytes(plan.usable_bytes)} usable ({fits}): {items}"
    )
