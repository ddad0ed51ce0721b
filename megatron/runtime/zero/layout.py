"""Where each element of a ZeRO partition lives.

The parameters of one optimizer group and one class (dense, or experts) are cut into buckets of
consecutive whole parameters. A bucket is padded to a multiple of the class's group size N
(data-parallel for dense, expert-data-parallel for experts) and cut into N equal chunks; rank r
owns chunk r of every bucket. A rank's `shard` is its chunks end to end: an fp32 nn.Parameter
that the optimizer updates in place of the model's parameters, so each rank holds about 1/N of
the optimizer state. Because each bucket is split on its own, one reduce-scatter (or all-gather)
per bucket moves exactly the bucket's chunks between the full layout and the shards.
"""

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn

from megatron import comm
from megatron.placement import expert_ids, tensor_parallel_split
from megatron.tensor_split import TensorParallelSplit


@dataclass(frozen=True)
class Bucket:
    """Parameters `params` (indices into the partition's list), `numel` elements before padding;
    `chunk` elements per rank. In the full padded layout it starts at `flat_start`; this rank's
    chunk starts at `shard_start` in the shard."""

    params: tuple[int, ...]
    numel: int
    chunk: int
    flat_start: int
    shard_start: int


@dataclass(frozen=True)
class Piece:
    """The part of one model tensor (or one expert of it) that a shard holds: elements
    [start, stop) of the flattened tensor `name` are shard elements [shard_start, shard_start +
    stop - start)."""

    name: str
    start: int
    stop: int
    shard_start: int


@dataclass(frozen=True)
class Unit:
    """A tensor as a checkpoint names it: a parameter, or one expert of a stacked one; for a
    tensor-parallel slice, `name` is the slice's entry and `whole_name` the tensor's, `split` how
    this rank's `shape` is cut from the whole (its dim counted within the unit)."""

    name: str
    whole_name: str
    shape: torch.Size
    split: TensorParallelSplit | None


def parameter_units(name: str, param: torch.Tensor) -> list[Unit]:
    ids, split = expert_ids(param), tensor_parallel_split(param)
    if ids is None:
        return [Unit(name if split is None else split.entry_name(name), name, param.shape, split)]
    expert_split = None if split is None else replace(split, dim=split.dim - 1)  # without the experts' dim
    return [
        Unit(
            f"{name}[{g}]" if split is None else split.entry_name(f"{name}[{g}]"),
            f"{name}[{g}]",
            param.shape[1:],
            expert_split,
        )
        for g in ids
    ]


def buckets_by_size(numels: Sequence[int], bucket_numel: int) -> list[list[int]]:
    """Consecutive parameters up to `bucket_numel` elements per bucket (a larger one alone)."""
    buckets: list[list[int]] = []
    filled = bucket_numel
    for index, numel in enumerate(numels):
        if filled + numel > bucket_numel:
            buckets.append([])
            filled = 0
        buckets[-1].append(index)
        filled += numel
    return buckets


class PartitionLayout:
    def __init__(
        self,
        params: list[nn.Parameter],
        names: list[str],
        group: dist.ProcessGroup | None,
        bucket_params: list[list[int]],
    ) -> None:
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(
                f"ZeRO needs one dtype per optimizer group and class of parameters, got {sorted(map(str, dtypes))}"
            )
        self.params = params
        self.names = names
        self.dtype = params[0].dtype
        self.device = params[0].device
        self.shapes = [p.shape for p in params]
        self.numels = [p.numel() for p in params]
        self.is_expert = expert_ids(params[0]) is not None
        self.group = group
        self.size = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        self.buckets: list[Bucket] = []
        self.param_offsets = [0] * len(params)  # where each parameter starts in the full layout
        flat_start = shard_start = 0
        for indices in bucket_params:
            offset = flat_start
            for index in indices:
                self.param_offsets[index] = offset
                offset += self.numels[index]
            numel = offset - flat_start
            chunk = -(-numel // self.size)  # ceil: padding keeps every chunk the same length
            self.buckets.append(Bucket(tuple(indices), numel, chunk, flat_start, shard_start))
            flat_start += chunk * self.size
            shard_start += chunk
        self.padded_numel, self.shard_numel = flat_start, shard_start

    def new_shard(self) -> nn.Parameter:
        """A zeroed fp32 master for this rank's chunks (subclasses decide whether they need one)."""
        return nn.Parameter(torch.zeros(self.shard_numel, dtype=torch.float32, device=self.device))

    def bucket_span(self, bucket: Bucket) -> slice:
        """The bucket's elements in the full padded layout."""
        return slice(bucket.flat_start, bucket.flat_start + bucket.chunk * self.size)

    def chunk_span(self, bucket: Bucket) -> slice:
        """This rank's chunk of the bucket in the shard."""
        return slice(bucket.shard_start, bucket.shard_start + bucket.chunk)

    def bucket_values(self, bucket: Bucket, tensors: list[torch.Tensor | None]) -> torch.Tensor:
        """The bucket's padded flat vector from one tensor per parameter (None reads as zeros)."""
        flat = torch.empty(bucket.chunk * self.size, dtype=self.dtype, device=self.device)
        flat[bucket.numel :] = 0  # the padding
        for index in bucket.params:
            start = self.param_offsets[index] - bucket.flat_start
            piece = flat[start : start + self.numels[index]]
            if tensors[index] is None:
                piece.zero_()
            else:
                piece.copy_(tensors[index].reshape(-1))
        return flat

    @torch.no_grad()
    def reduce_and_free_gradients(
        self,
        bucket: Bucket,
        async_op: bool,
    ) -> tuple[dist.Work | None, Callable[[], None] | None]:
        """Move the bucket's gradients into one padded vector (freeing them), reduce-scatter it
        and add this rank's chunk to `shard_grad` (partitioned gradients: stages 2 and 3). A
        parameter without a gradient adds zeros. On one rank each gradient is added in place."""
        slot = self.shard_grad[self.chunk_span(bucket)]
        if self.size == 1:
            for index in bucket.params:
                grad, self.params[index].grad = self.params[index].grad, None
                if grad is not None:
                    start = self.param_offsets[index] - bucket.flat_start
                    slot[start : start + self.numels[index]] += grad.reshape(-1)
            return None, None
        full = self.bucket_values(bucket, [p.grad for p in self.params])
        for index in bucket.params:
            self.params[index].grad = None
        received = torch.empty(bucket.chunk, dtype=self.dtype, device=self.device)
        work = comm.reduce_scatter_tensor(received, full, group=self.group, async_op=async_op)
        return work, lambda: slot.add_(received)

    def pieces(self) -> Iterator[Piece]:
        """This rank's share of each model tensor, experts one by one under their global ids, a
        tensor-parallel slice under its slice's name."""
        for bucket in self.buckets:
            lo = bucket.flat_start + self.rank * bucket.chunk
            hi = lo + bucket.chunk
            for index in bucket.params:
                units = parameter_units(self.names[index], self.params[index])
                unit_numel = self.numels[index] // len(units)
                for position, unit in enumerate(units):
                    begin = self.param_offsets[index] + position * unit_numel
                    start, stop = max(lo, begin), min(hi, begin + unit_numel)
                    if start < stop:
                        yield Piece(unit.name, start - begin, stop - begin, bucket.shard_start + start - lo)
