"""Flat fp32 partitions for ZeRO stages 1 and 2.

The parameters of one optimizer group and one class (dense, or experts) are laid out end to end
in a flat buffer padded to a multiple of the class's group size N (data-parallel for dense,
expert-data-parallel for experts). Rank r owns the slice [r*L, (r+1)*L): its `shard`, an fp32
nn.Parameter that the optimizer updates in place of the model's parameters, so the optimizer
state on each rank is about 1/N of the whole.
"""

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from megatron.runtime.state_io import expert_ids


@dataclass(frozen=True)
class Piece:
    """The part of one model tensor (or one expert of it) that a shard holds: elements
    [start, stop) of the flattened tensor `name` are shard elements [shard_start, shard_start +
    stop - start)."""
    name: str
    start: int
    stop: int
    shard_start: int


class FlatPartition:
    """Owns two flat buffers of `padded_numel` elements that the model's parameters and their
    gradients are views of: the all-gather of updated shards writes straight into the parameters
    and autograd accumulates straight into the flat gradients, so a step needs no concatenation
    and no copy back."""

    def __init__(self, params: list[nn.Parameter], names: list[str], group: dist.ProcessGroup | None) -> None:
        self.params = params
        self.names = names
        self.is_expert = expert_ids(params[0]) is not None
        self.group = group
        self.size = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        self.numels = [p.numel() for p in params]
        total = sum(self.numels)
        self.shard_numel = -(-total // self.size)  # ceil: padding keeps every shard the same length
        self.padded_numel = self.shard_numel * self.size
        self.lo = self.rank * self.shard_numel
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(f"ZeRO needs one dtype per optimizer group and class of parameters, got {sorted(map(str, dtypes))}")
        device = params[0].device
        # padding stays zero in both buffers: nothing views it
        self.flat_params = torch.zeros(self.padded_numel, dtype=params[0].dtype, device=device)
        self.flat_grads = torch.zeros_like(self.flat_params)
        self.param_views = self._views(self.flat_params)
        self.grad_views = self._views(self.flat_grads)
        # the master stays a tensor of its own: it is all-gathered into flat_params, and a
        # collective's input must not overlap its output
        self.shard = nn.Parameter(torch.empty(self.shard_numel, dtype=torch.float32, device=device))
        self.copy_from_parameters()

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [v.view_as(p) for v, p in zip(flat[:sum(self.numels)].split(self.numels), self.params)]

    @torch.no_grad()
    def _attach_parameters(self, keep_values: bool) -> None:
        """Make every parameter a view of flat_params again (the same nn.Parameter object: the
        optimizer, the schedule and checkpoints key on it). A parameter whose .data was replaced
        since (say, by a load that assigns) brings its values along when `keep_values`."""
        for param, view in zip(self.params, self.param_views):
            if param.data_ptr() != view.data_ptr():
                if keep_values:
                    view.copy_(param.detach())
                param.data = view

    @torch.no_grad()
    def _attach_gradients(self) -> None:
        """Point each .grad at its view of flat_grads. A .grad set to None since the last step
        means no gradient (its view was zeroed at the step); one replaced by a new tensor carries
        the gradient, copied in."""
        for param, view in zip(self.params, self.grad_views):
            grad = param.grad
            if grad is None or grad.data_ptr() != view.data_ptr():
                if grad is not None:
                    view.copy_(grad)
                param.grad = view

    @torch.no_grad()
    def copy_from_parameters(self) -> None:
        """Take this rank's slice of the model's parameters as the fp32 master (at the start and
        after a checkpoint wrote new weights into the model)."""
        self._attach_parameters(keep_values=True)
        self._attach_gradients()
        self.shard.copy_(self.flat_params[self.lo:self.lo + self.shard_numel])

    def reduce_gradients(self, stage: int) -> None:
        """Sum the model gradients over the group into `shard.grad`. Stage 1 sums the whole
        buffer (all-reduce, in place) and takes a view of its slice; stage 2 receives only its
        slice (reduce-scatter)."""
        self._attach_gradients()
        if self.size == 1:
            self.shard.grad = self.flat_grads.float()  # a view when the model is fp32
        elif stage == 1:
            dist.all_reduce(self.flat_grads, group=self.group)
            self.shard.grad = self.flat_grads[self.lo:self.lo + self.shard_numel].float()
        else:
            grad = torch.empty(self.shard_numel, dtype=self.flat_grads.dtype, device=self.flat_grads.device)
            dist.reduce_scatter_single(grad, self.flat_grads, group=self.group)
            self.shard.grad = grad.float()

    @torch.no_grad()
    def zero_gradients(self) -> None:
        """Clear the model's gradients for the next accumulation, keeping them views (the engine
        calls this after each step, whether or not the optimizer stepped)."""
        self.flat_grads.zero_()
        self._attach_gradients()

    @torch.no_grad()
    def gather_parameters(self) -> None:
        """Write every rank's updated shard into flat_params, and so into the model's parameters."""
        self._attach_parameters(keep_values=False)  # every value is overwritten below
        shard = self.shard.detach()
        if self.size == 1:
            self.flat_params.copy_(shard)
        elif self.flat_params.dtype == shard.dtype:
            dist.all_gather_single(self.flat_params, shard, group=self.group)
        else:  # a low-precision model: gather the fp32 master, then round once
            flat = torch.empty(self.padded_numel, dtype=shard.dtype, device=shard.device)
            dist.all_gather_single(flat, shard, group=self.group)
            self.flat_params.copy_(flat)

    def pieces(self) -> Iterator[Piece]:
        """This rank's share of each model tensor, experts one by one under their global ids."""
        offset, hi = 0, self.lo + self.shard_numel
        for param, name, numel in zip(self.params, self.names, self.numels):
            ids = expert_ids(param)
            units = [(name, 0)] if ids is None else [(f"{name}[{g}]", i) for i, g in enumerate(ids)]
            unit_numel = numel // len(units)
            for unit_name, index in units:
                begin = offset + index * unit_numel
                start, stop = max(self.lo, begin), min(hi, begin + unit_numel)
                if start < stop:
                    yield Piece(unit_name, start - begin, stop - begin, start - self.lo)
            offset += numel


def build_partitions(
    optimizer: torch.optim.Optimizer, names: dict[nn.Parameter, str],
    dense_group: dist.ProcessGroup | None, expert_group: dist.ProcessGroup | None,
) -> list[FlatPartition]:
    """Partition each optimizer group's dense and expert parameters, and point the optimizer at
    the shards instead. The optimizer object and its groups stay the same (an LR schedule
    already holds them); each group now holds one shard per class."""
    partitions = []
    for group in optimizer.param_groups:
        shards = []
        for is_expert, comm in ((False, dense_group), (True, expert_group)):
            params = [p for p in group["params"] if (expert_ids(p) is not None) == is_expert]
            if params:
                partitions.append(FlatPartition(params, [names[p] for p in params], comm))
                shards.append(partitions[-1].shard)
        group["params"] = shards
    optimizer.state.clear()
    return partitions
