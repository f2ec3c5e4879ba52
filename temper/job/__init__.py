"""What every job (RL, SFT) shares: the model it trains and its run's checkpoints."""

from temper.job.model import ModelChoice
from temper.job.run_checkpoints import RunCheckpoints, state_to_resume

__all__ = ["ModelChoice", "RunCheckpoints", "state_to_resume"]
