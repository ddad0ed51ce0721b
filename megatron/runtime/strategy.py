"""The one protocol through which the engine drives how parameters, gradients and optimizer state
are laid out over the data-parallel ranks: replicated (ZeRO stage 0, megatron/runtime/replicated.py)
or partitioned (stages 1-3, megatron/runtime/zero/). The engine calls the same methods at the same
points of every step whatever the stage, so it has one code path; a back end for accelerators
(FSDP2, say) would be one more class with these methods.

The order of calls in one optimizer step, for every micro-batch then at the boundary:

    with forward_context(): forward      before_backward(boundary); backward; after_backward()
    reduce_gradients() -> (dense, expert) gradients the optimizer reads
    gradient_kinds()                     which gradients are tensor-parallel slices or copies
    sum_square_norms(...)                the norm's partial sums over the groups that split them
    optimizer.step(); after_step()       (skipped on a non-finite step)
    zero_gradients()                     (always)
"""

from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch
from torch import nn

from megatron.checkpoint.tensors import ShardedReader
from megatron.parallel import ParallelGrid
from megatron.placement import pipeline_shared
from megatron.runtime.config.schema import RuntimeConfig
from megatron.runtime.replicated import Replicated
from megatron.runtime.swap.param_store import ShardStore
from megatron.runtime.zero import ZeroRuntime
from megatron.runtime.zero.layout import PartitionLayout


class TrainingStrategy(Protocol):
    stage: int  # DeepSpeed's ZeRO stage, 0 for replicated
    partitions: list[PartitionLayout]  # the flat shards the optimizer holds ([] when replicated)

    def forward_context(self) -> AbstractContextManager[Any]:
        """Where the model's forward runs."""

    def full_parameters(self) -> AbstractContextManager[Any]:
        """Every parameter whole while the block runs (saving, loading, inspecting weights)."""

    def before_backward(self, boundary: bool) -> None:
        """A backward starts; `boundary`: it ends an accumulation."""

    def after_backward(self) -> None:
        """A backward has finished."""

    def reduce_gradients(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Sum the accumulation's gradients over their data-parallel groups; return the (dense,
        expert) gradients that the optimizer will read and the step scales in place."""

    def gradient_kinds(self) -> tuple[list[str], list[str]]:
        """For each (dense, expert) gradient `reduce_gradients` returns, its kind
        (megatron/runtime/gradient_kinds.py)."""

    def sum_square_norms(self, dense_sq: torch.Tensor, expert_sq: torch.Tensor) -> None:
        """Sum in place the squared norms of this rank's gradients over the data-parallel groups
        that hold disjoint parts of them (none when every rank holds them whole)."""

    def after_step(self) -> None:
        """The optimizer updated what it holds: bring it into the model's parameters."""

    def zero_gradients(self) -> None:
        """Clear gradients for the next accumulation (after the optimizer's zero_grad)."""

    def copy_from_parameters(self) -> None:
        """The model's (whole) parameters were overwritten, by a load: take them as the master."""

    def optimizer_state(self, owns_dense: bool, owns_experts: bool) -> dict[str, torch.Tensor]:
        """This rank's share of the optimizer state as global checkpoint entries."""

    def load_optimizer_state(self, reader: ShardedReader, saved_groups: list[dict[str, Any]]) -> None:
        """Restore the optimizer state from a checkpoint saved under any stage and layout."""

    def swapped_stores(self) -> dict[torch.Tensor, ShardStore]:
        """The optimizer's tensors whose master values live partly in swap files."""


def build_strategy(
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    config: RuntimeConfig,
    grid: ParallelGrid,
) -> TrainingStrategy:
    """The strategy for the config's ZeRO stage. From here on, under ZeRO, the optimizer's groups
    hold this rank's shards instead of the model's parameters."""
    if config.zero_optimization.stage == 0:
        return Replicated(module, optimizer, grid)
    return ZeroRuntime(
        module,
        optimizer,
        config.zero_optimization,
        grid.dp_group,
        grid.expert_dp_group,
        config.aio,
        grid.rank,
        grid.tp_rank,
        grid.expert_tp_rank,
        reduce_in_backward=not pipeline_shared(module),
    )
