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
        self.shard = nn.Parameter(torch.empty(self.shard_numel, dtype=torch.float32, device=params[0].device))
        self.copy_from_parameters()

    @torch.no_grad()
    def copy_from_parameters(self) -> None:
        """Take this rank's slice of the model's parameters as the fp32 master (at the start and
        after a checkpoint wrote new weights into the model)."""
        self.shard.copy_(self._flat(list(self.params))[self.lo:self.lo + self.shard_numel])

    def _flat(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        flat = torch.cat([t.reshape(-1) for t in tensors])
        return nn.functional.pad(flat, (0, self.padded_numel - flat.numel()))

    def reduce_gradients(self, stage: int) -> None:
        """Sum the model gradients over the group into `shard.grad`, then free them. Stage 1 sums
        the whole buffer (all-reduce) and keeps its slice; stage 2 receives only its slice
        (reduce-scatter)."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = self._flat(grads).float()
        for param in self.params:
            param.grad = None
        if self.size == 1:
            self.shard.grad = flat
        elif stage == 1:
            dist.all_reduce(flat, group=self.group)
            self.shard.grad = flat[self.lo:self.lo + self.shard_numel].clone()
        else:
            self.shard.grad = torch.empty_like(self.shard)
            dist.reduce_scatter_single(self.shard.grad, flat, group=self.group)

    def gather_parameters(self) -> None:
        """Copy every rank's updated shard back into the model's parameters."""
        if self.size == 1:
            flat = self.shard.detach()
        else:
            flat = torch.empty(self.padded_numel, dtype=self.shard.dtype, device=self.shard.device)
            dist.all_gather_single(flat, self.shard.detach(), group=self.group)
        with torch.no_grad():
            values = flat[:sum(self.numels)].split(self.numels)
            torch._foreach_copy_([p.view(-1) for p in self.params], [v.to(p.dtype) for v, p in zip(values, self.params)])

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
