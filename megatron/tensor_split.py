"""How a tensor-parallel parameter is split over its group, and the slicing and joining of tensors
that the model (its layers), the checkpoint (whole tensors at any TP size) and the runtime (ZeRO's
layout) share. The split is part of a parameter's placement (megatron/placement.py)."""

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron import comm
from megatron.errors import ConfigError

TP_SLICE_MARK = "~tp"  # "exp_avg/layers.0.dense.weight~tp1of2": slice 1 of 2


def check_divisible(n: int, size: int, what: str, fix: str) -> None:
    if n % size:
        raise ConfigError(f"{what} ({n}) is not divisible by the tensor-parallel size {size}; {fix}")


def partition_widths(width: int, size: int, partition_sizes: Sequence[int] | None, what: str, fix: str) -> list[int]:
    """The widths of the parts that make up `width` (one part unless given), each checked to split evenly."""
    parts = list(partition_sizes) if partition_sizes is not None else [width]
    if sum(parts) != width:
        raise ConfigError(
            f"the partition sizes {parts} of {what} add up to {sum(parts)}, not {width}; list the width of every part"
        )
    for index, part in enumerate(parts):
        check_divisible(part, size, what if len(parts) == 1 else f"part {index} of {what} {parts}", fix)
    return parts


def shard(
    full: torch.Tensor, dim: int, rank: int, size: int, partition_sizes: Sequence[int] | None = None
) -> torch.Tensor:
    """Rank `rank`'s slice of `full` along `dim` out of `size`: the rank-th equal piece of every part,
    where `partition_sizes` lists the widths of the concatenated parts (e.g. q, k, v) or the whole
    dim is one part. A new tensor, not a view of `full`."""
    parts = partition_widths(
        full.shape[dim],
        size,
        partition_sizes,
        f"dimension {dim} of a {tuple(full.shape)} tensor",
        "choose a tensor-parallel size that divides it",
    )
    return torch.cat([part.chunk(size, dim)[rank] for part in full.split(parts, dim)], dim)


def unshard(pieces: list[torch.Tensor], dim: int, partition_sizes: Sequence[int] | None = None) -> torch.Tensor:
    """The full tensor whose `shard`s along `dim` are `pieces` (in rank order); `partition_sizes`
    are the FULL widths of the parts, as given to `shard`."""
    size = len(pieces)
    width = sum(piece.shape[dim] for piece in pieces)
    parts = partition_widths(
        width,
        size,
        partition_sizes,
        f"dimension {dim} of the {size} pieces",
        "pass the partition sizes the pieces were sharded with",
    )
    pieces_by_part = [piece.split([part // size for part in parts], dim) for piece in pieces]  # [rank][part]
    return torch.cat([by_part[index] for index in range(len(parts)) for by_part in pieces_by_part], dim)


def gather_list(x: torch.Tensor, group: dist.ProcessGroup) -> list[torch.Tensor]:
    x = x.contiguous()
    pieces = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    comm.all_gather(pieces, x, group=group)
    return pieces


@dataclass(frozen=True, eq=False)
class TensorParallelSplit:
    """How a parameter is split over the tensor-parallel group: along `dim`, each of the parts of
    `partition_sizes` (full widths) on its own, or the whole dim as one part when None; this rank
    holds slice `rank` of `size`. Checkpoints use it to save and load whole tensors, or this rank's
    slice under `entry_name`, whatever the tensor-parallel size of the run that reads them."""

    dim: int
    partition_sizes: tuple[int, ...] | None
    rank: int
    size: int
    group: dist.ProcessGroup

    def slice_of(self, whole: torch.Tensor) -> torch.Tensor:
        return shard(whole, self.dim, self.rank, self.size, self.partition_sizes)

    def whole_of(self, piece: torch.Tensor) -> torch.Tensor:
        """The whole tensor from every rank's slice (a collective over the group)."""
        return unshard(gather_list(piece, self.group), self.dim, self.partition_sizes)

    def whole_shape(self, piece_shape: torch.Size) -> torch.Size:
        shape = list(piece_shape)
        shape[self.dim] *= self.size
        return torch.Size(shape)

    def entry_name(self, name: str, rank: int | None = None, size: int | None = None) -> str:
        """The checkpoint name of slice `rank` of `size` (default: this rank's) of tensor `name`."""
        return f"{name}{TP_SLICE_MARK}{self.rank if rank is None else rank}of{self.size if size is None else size}"
