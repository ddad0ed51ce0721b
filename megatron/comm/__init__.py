"""Communication: the collectives the toolkit issues (collectives.py) and DeepSpeed's
communication logger over them (comms_log.py)."""

from megatron.comm.collectives import (
    P2POp,
    ReduceOp,
    all_gather,
    all_gather_into_tensor,
    all_reduce,
    all_to_all_single,
    batch_isend_irecv,
    broadcast,
    reduce_scatter,
    reduce_scatter_tensor,
)
from megatron.comm.comms_log import CommsLog, log_summary

__all__ = [
    "CommsLog",
    "P2POp",
    "ReduceOp",
    "all_gather",
    "all_gather_into_tensor",
    "all_reduce",
    "all_to_all_single",
    "batch_isend_irecv",
    "broadcast",
    "log_summary",
    "reduce_scatter",
    "reduce_scatter_tensor",
]
