"""Reinforcement learning: environments, rollouts, advantages, KL, the RL job and its loops."""
