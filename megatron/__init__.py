"""Megatron-style pretraining toolkit for dense and Mixture-of-Experts GPT models."""

__version__ = "0.1.0"
