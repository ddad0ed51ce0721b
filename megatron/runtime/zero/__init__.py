"""ZeRO stages 1-3: flat fp32 master partitions of optimizer state, gradients and parameters."""

from megatron.runtime.zero.stages import ZeroRuntime

__all__ = ["ZeroRuntime"]
