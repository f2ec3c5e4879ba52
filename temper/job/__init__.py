"""What every job (RL, SFT) shares: the model it trains, its run's checkpoints, and the plan of
the memory its ranks hold."""

from temper.job.memory_plan import MemoryPlan, PlanSettings, plan_memory
from temper.job.memory_report import describe_for_rank
from temper.job.model import (
    ModelChoice,
    check_generator_model,
    check_generator_ranks,
    model_shapes,
)
from temper.job.run_checkpoints import (
    CHECKPOINTS_DIR,
    RunCheckpoints,
    other_world_note,
    state_to_resume,
)

__all__ = [
    "CHECKPOINTS_DIR",
    "MemoryPlan",
    "ModelChoice",
    "PlanSettings",
    "RunCheckpoints",
    "check_generator_model",
    "check_generator_ranks",
    "describe_for_rank",
    "model_shapes",
    "other_world_note",
    "plan_memory",
    "state_to_resume",
]
