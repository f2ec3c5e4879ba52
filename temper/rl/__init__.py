"""Reinforcement learning: tasks and environments (loops come with the RL issue)."""
