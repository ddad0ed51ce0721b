"""ZeRO stages 1 and 2: flat fp32 master partitions of optimizer state (and gradients)."""

from megatron.runtime.zero.checkpoint import load_partition_state, partition_state_entries
from megatron.runtime.zero.partition import FlatPartition, build_partitions

__all__ = ["FlatPartition", "build_partitions", "load_partition_state", "partition_state_entries"]
