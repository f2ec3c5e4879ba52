"""What every job (RL, SFT) shares: the model it trains and its run's checkpoints."""

from temper.job.model import ModelChoice, check_generator_ranks
from temper.job.run_checkpoints import RunCheckpoints, state_to_resume

__all__ = ["ModelChoice", "RunCheckpoints", "check_generator_ranks", "state_to_resume"]
