"""Layers shared by model families."""
