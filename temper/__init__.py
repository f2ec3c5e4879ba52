"""Temper: PyTorch-native RL post-training with a Tinker-style API."""

__version__ = "0.1.0"
