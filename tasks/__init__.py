"""Downstream evaluation of trained checkpoints."""
