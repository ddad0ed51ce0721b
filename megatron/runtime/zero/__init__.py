"""ZeRO stages 1-3: flat fp32 master partitions of optimizer state, gradients and parameters."""

from megatron.runtime.zero.checkpoint import load_partition_state, partition_state_entries
from megatron.runtime.zero.stages import ZeroRuntime

__all__ = ["ZeroRuntime", "load_partition_state", "partition_state_entries"]
