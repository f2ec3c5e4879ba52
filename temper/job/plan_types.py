"""What a memory plan is (memory_plan.py computes it, memory_report.py renders it): for each
role, rows of (item, bytes, phase), and the plan's verdict against a GPU's memory.

A row's phase says when it is held: `always`, only while `training` (from the first backward
to the optimizer step), or only during a `sync` (pushing new weights to the generator). A
role's peak is what it always holds plus its larger phase.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from temper.job.plan_settings import PlanSettings
from temper.job.runtime_bytes import Role

Phase = Literal["always", "training", "sync"]
GIB, MIB = 2**30, 2**20


@dataclass(frozen=True, kw_only=True)
class PlanRow:
    item: str
    num_bytes: int
    phase: Phase = "always"


@dataclass(frozen=True, kw_only=True)
class RolePlan:
    role: Role
    num_ranks: int
    description: str
    rows: tuple[PlanRow, ...]

    def total(self, phase: Phase = "always") -> int:
        """Bytes held during `phase`: the `always` rows plus that phase's own."""
        return sum(row.num_bytes for row in self.rows if row.phase in ("always", phase))

    @property
    def steady_bytes(self) -> int:
        return self.total("always")

    @property
    def peak_phase(self) -> Phase:
        return max(("training", "sync"), key=self.total)

    @property
    def peak_bytes(self) -> int:
        return self.total(self.peak_phase)


@dataclass(frozen=True, kw_only=True)
class MemoryPlan:
    settings: PlanSettings
    model_name: str
    num_params: int
    """Parameters of the plain model (tied embeddings counted once)."""
    num_active_params: int
    """Parameters one token uses: `num_params` for a dense model, less the experts a MoE
    model's router does not pick."""
    roles: tuple[RolePlan, ...]

    @property
    def usable_bytes(self) -> int:
        """GPU memory less the headroom."""
        settings = self.settings
        return int(settings.gpu_memory_gib * GIB * (1 - settings.headroom))

    @property
    def fits(self) -> bool:
        return all(role.peak_bytes <= self.usable_bytes for role in self.roles)

    def role(self, role: Role) -> RolePlan:
        for plan in self.roles:
            if plan.role == role:
                return plan
        have = ", ".join(plan.role for plan in self.roles)
        raise ValueError(f"role {role!r} is not in this plan ({have})")
