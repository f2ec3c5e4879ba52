"""What every job (RL, SFT) shares: the model it trains and its run's checkpoints."""

from temper.job.model import ModelChoice
from temper.job.run_checkpoints import RunCheckpoints

__all__ = ["ModelChoice", "RunCheckpoints"]
