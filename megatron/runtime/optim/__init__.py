"""Optimizers the runtime steps itself: the CPU Adam for optimizer state in host memory."""

from megatron.runtime.optim.cpu_adam import CPUAdam

__all__ = ["CPUAdam"]
