"""The collectives and point-to-point ops the toolkit issues, as torch.distributed's functions
with the same arguments: each goes straight to torch, or, while a communication log records
(comms_log.py), through it with its message size. The cost when nothing records is one
attribute read."""

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from megatron.comm.comms_log import INSTALLED

ReduceOp = dist.ReduceOp
P2POp = dist.P2POp


def _bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _issue(op: str, message_bytes: Callable[[], int], group: Any, issue: Callable[[], Any]) -> Any:
    log = INSTALLED.value
    if log is None or not log.logs(op):
        return issue()
    return log.timed(op, message_bytes(), group, issue)


def all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False) -> Any:
    return _issue("all_reduce", lambda: _bytes(tensor), group, lambda: dist.all_reduce(tensor, op, group, async_op))


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None, async_op: bool = False) -> Any:
    return _issue(
        "all_gather",
        lambda: sum(_bytes(t) for t in tensor_list),
        group,
        lambda: dist.all_gather(tensor_list, tensor, group, async_op),
    )


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, group: Any = None, async_op: bool = False) -> Any:
    return _issue(
        "all_gather_into_tensor",
        lambda: _bytes(output),
        group,
        lambda: dist.all_gather_single(output, input, group, async_op),
    )


def reduce_scatter(
    output: torch.Tensor, input_list: list[torch.Tensor], group: Any = None, async_op: bool = False
) -> Any:
    return _issue(
        "reduce_scatter",
        lambda: sum(_bytes(t) for t in input_list),
        group,
        lambda: dist.reduce_scatter(output, input_list, group=group, async_op=async_op),
    )


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, group: Any = None, async_op: bool = False) -> Any:
    return _issue(
        "reduce_scatter_tensor",
        lambda: _bytes(input),
        group,
        lambda: dist.reduce_scatter_single(output, input, group=group, async_op=async_op),
    )


def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    group: Any = None,
    async_op: bool = False,
) -> Any:
    return _issue(
        "all_to_all_single",
        lambda: _bytes(input),
        group,
        lambda: dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group, async_op),
    )


def broadcast(tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False) -> Any:
    return _issue("broadcast", lambda: _bytes(tensor), group, lambda: dist.broadcast(tensor, src, group, async_op))


def batch_isend_irecv(ops: list[dist.P2POp]) -> list[Any]:
    """Logged as one op: "send", "recv", or "sendrecv" (its size the bytes sent) when it has both."""
    sends = [op.tensor for op in ops if op.op is dist.isend]
    name = ("send" if len(sends) == len(ops) else "sendrecv") if sends else "recv"
    return _issue(
        name,
        lambda: sum(_bytes(t) for t in (sends or [op.tensor for op in ops])),
        ops[0].group,
        lambda: dist.batch_isend_irecv(ops),
    )
