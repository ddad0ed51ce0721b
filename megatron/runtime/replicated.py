"""ZeRO stage 0: every data-parallel rank holds the whole model, its gradients and the optimizer
state; at the accumulation boundary the gradients are summed over the data-parallel group (experts
over their expert-data-parallel group), one flat buffer per dtype.
"""

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megatron import comm
from megatron.checkpoint.tensors import ShardedReader, load_optimizer_entries, optimizer_entries
from megatron.parallel import ParallelGrid, is_parallel
from megatron.placement import expert_ids, gradient_kind
from megatron.runtime.swap.param_store import ShardStore
from megatron.runtime.zero.layout import PartitionLayout


def sum_over(grads: list[torch.Tensor], group: dist.ProcessGroup | None) -> None:
    """Sum gradients over a group, one flat buffer per dtype."""
    if not is_parallel(group) or not grads:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for grad in grads:
        by_dtype.setdefault(grad.dtype, []).append(grad)
    for same_dtype in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in same_dtype])
        comm.all_reduce(flat, group=group)
        torch._foreach_copy_(
            same_dtype, [t.view_as(g) for t, g in zip(flat.split([g.numel() for g in same_dtype]), same_dtype)]
        )


class Replicated:
    stage = 0

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, grid: ParallelGrid) -> None:
        self.optimizer = optimizer
        self.grid = grid
        self.partitions: list[PartitionLayout] = []
        params = [p for group in optimizer.param_groups for p in group["params"]]
        self.dense_params = [p for p in params if expert_ids(p) is None]
        self.expert_params = [p for p in params if expert_ids(p) is not None]
        self.param_names = {p: n for n, p in module.named_parameters()}

    def forward_context(self) -> AbstractContextManager[Any]:
        return nullcontext()

    full_parameters = forward_context

    def before_backward(self, boundary: bool) -> None:
        pass

    def after_backward(self) -> None:
        pass

    def local_gradients(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """This rank's own (dense, expert) gradients, unreduced (1-bit Adam's compression stage)."""
        for param in (*self.dense_params, *self.expert_params):
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        return [p.grad for p in self.dense_params], [p.grad for p in self.expert_params]

    def reduce_gradients(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        dense_grads, expert_grads = self.local_gradients()
        sum_over(dense_grads, self.grid.dp_group)
        # an expert's gradient already holds its expert-parallel group's tokens; summing over its
        # copies and dividing by the full data-parallel size makes EP=N equal EP=1
        sum_over(expert_grads, self.grid.expert_dp_group)
        return dense_grads, expert_grads

    def gradient_kinds(self) -> tuple[list[str], list[str]]:
        return [gradient_kind(p) for p in self.dense_params], [gradient_kind(p) for p in self.expert_params]

    def sum_square_norms(self, dense_sq: torch.Tensor, expert_sq: torch.Tensor) -> None:
        pass  # every data-parallel rank holds the whole gradients

    def after_step(self) -> None:
        pass  # the optimizer updated the model's parameters themselves

    def zero_gradients(self) -> None:
        pass  # the optimizer's zero_grad set them to None

    def copy_from_parameters(self) -> None:
        pass

    def optimizer_state(self, owns_dense: bool, owns_experts: bool) -> dict[str, torch.Tensor]:
        return optimizer_entries(self.optimizer, self.param_names, owns_dense, owns_experts)

    def load_optimizer_state(self, reader: ShardedReader, saved_groups: list[dict[str, Any]]) -> None:
        load_optimizer_entries(self.optimizer, self.param_names, reader, saved_groups)

    def swapped_stores(self) -> dict[torch.Tensor, ShardStore]:
        return {}
