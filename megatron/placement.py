"""Where a parameter lives across the ranks, as one record per parameter: the model sets it when it
builds its layers, the runtime (gradient reduction, the gradient norm, ZeRO's layout) and the
checkpoint (global names, whole tensors at any layout) read it, and neither imports the model.

A parameter without a record is a plain one: whole on every rank, no expert, one pipeline stage.
"""

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from megatron.parallel import ParallelGrid
from megatron.tensor_split import TensorParallelSplit

# What a parameter's gradient is across model-parallel ranks, for the gradient norm: a
# tensor-parallel slice (the slices add up over the tensor-parallel group), whole on every
# tensor-parallel rank (counted once), or a pipeline stage's copy of a parameter the first stage
# holds (the tied word embedding on the last stage: its gradient is summed into the first stage's,
# which alone counts it).
SLICE, WHOLE, COPY = "slice", "whole", "copy"


@dataclass(frozen=True)
class Placement:
    expert_ids: tuple[int, ...] | None = None  # global ids of the experts a stacked expert tensor holds
    tp_split: TensorParallelSplit | None = None  # how it is split over the tensor-parallel group
    pipeline_shared: bool = False  # the first and last stages both hold it (a tied word embedding)
    copy_of_first_stage: bool = False  # and this is the last stage's copy

    @property
    def gradient_kind(self) -> str:
        if self.copy_of_first_stage:
            return COPY
        return SLICE if self.tp_split is not None else WHOLE

    def replica_group(self, grid: ParallelGrid) -> dist.ProcessGroup | None:
        """The ranks that hold the same values and average its gradient: the expert-data-parallel
        group for an expert, the data-parallel group for the rest."""
        return grid.expert_dp_group if self.expert_ids else grid.dp_group


_PLAIN = Placement()


def placement_of(tensor: torch.Tensor) -> Placement:
    return getattr(tensor, "placement", _PLAIN)


def place(param: torch.Tensor, **fields: object) -> None:
    """Set fields of `param`'s placement, keeping the others."""
    param.placement = replace(placement_of(param), **fields)


def expert_ids(tensor: torch.Tensor) -> tuple[int, ...] | None:
    return placement_of(tensor).expert_ids


def tensor_parallel_split(tensor: torch.Tensor) -> TensorParallelSplit | None:
    """The split of a tensor-parallel parameter; None for one every tensor-parallel rank holds whole."""
    return placement_of(tensor).tp_split


def local_part(param: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """What this rank holds of `whole`, the value of `param` as one process holds it: its
    tensor-parallel slice, or all of it."""
    split = tensor_parallel_split(param)
    return whole if split is None else split.slice_of(whole)


def pipeline_shared(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters the first and last pipeline stages both hold (a tied word embedding), whose
    gradients are summed over the two before each step."""
    return [p for p in module.parameters() if placement_of(p).pipeline_shared]


def gradient_kind(param: torch.Tensor) -> str:
    return placement_of(param).gradient_kind
