"""The rank grid: world, tensor-, data-, pipeline- and expert-parallel groups and the device, built
once and passed down.

Ranks follow Megatron-Core's default order (tp fastest, then dp, then pp slowest):

    rank = tp_rank + tp_size * (dp_rank + dp_size * pp_rank)

so tp=2, pp=2 on 8 ranks gives tp groups [0,1] [2,3] [4,5] [6,7], dp groups [0,2] [1,3] [4,6] [5,7]
and pp groups [0,4] [1,5] [2,6] [3,7]. Experts re-divide the tp*dp ranks of each pipeline stage as
expert-tp (fastest), expert-parallel (EP), expert-data-parallel (slowest):

    rank = expert_tp_rank + expert_tp_size * (ep_rank + ep_size * (expert_dp_rank + expert_dp_size * pp_rank))

With tp = pp = expert-tp = 1 every rank is data-parallel for dense parameters, EP groups are
consecutive ranks and the copies of one expert live on the strided expert-data-parallel group.
Launched by torchrun (WORLD_SIZE set), torch.distributed is initialised with gloo on the CPU or
NCCL on CUDA; launched as plain `python`, everything is single-process and no group exists.
"""

import math
import os
import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron import comm
from megatron.errors import ConfigError

Groups = tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class ParallelGrid:
    """This rank's size, place and group on every axis. In a multi-process run every group but
    `embedding_group` exists, single-rank ones included, so a raw `dist` call never falls back to
    the world group on a None."""

    world_size: int
    rank: int
    dp_size: int
    dp_rank: int
    dp_group: dist.ProcessGroup | None
    device: torch.device
    ep_size: int = 1
    ep_rank: int = 0
    ep_group: dist.ProcessGroup | None = None
    expert_dp_size: int = 1
    expert_dp_rank: int = 0
    expert_dp_group: dist.ProcessGroup | None = None
    tp_size: int = 1
    tp_rank: int = 0
    tp_group: dist.ProcessGroup | None = None
    pp_size: int = 1
    pp_rank: int = 0
    pp_group: dist.ProcessGroup | None = None
    expert_tp_size: int = 1
    expert_tp_rank: int = 0
    expert_tp_group: dist.ProcessGroup | None = None
    # First and last pipeline stage at this tp/dp position, which both hold the tied embedding;
    # None without pipeline parallelism and on the stages in between.
    embedding_group: dist.ProcessGroup | None = None
    # every rank of this pipeline stage (tp x dp): the ranks that share out a global batch's tokens,
    # each sequence's positions over tp under sequence parallelism; the data-parallel group when tp = 1
    stage_group: dist.ProcessGroup | None = None

    @property
    def is_first_rank(self) -> bool:
        return self.rank == 0

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def pp_prev_rank(self) -> int | None:
        """Global rank of the previous pipeline stage at this tp/dp position; None on the first stage."""
        return None if self.is_first_stage else self.rank - self.tp_size * self.dp_size  # pp varies slowest

    @property
    def pp_next_rank(self) -> int | None:
        """Global rank of the next pipeline stage at this tp/dp position; None on the last stage."""
        return None if self.is_last_stage else self.rank + self.tp_size * self.dp_size

    def checkpoint_owners(self) -> dict[str, bool]:
        """Which whole tensors this rank writes to a checkpoint: a pipeline stage's dense ones (gathered
        over tp) by its first rank, each expert's (gathered over expert-tp) by the first of its copies."""
        return {
            "owns_dense": self.dp_rank == 0 and self.tp_rank == 0,
            "owns_experts": self.expert_dp_rank == 0 and self.expert_tp_rank == 0,
        }

    def describe(self) -> str:
        return (
            f"world {self.world_size} = tp {self.tp_size} x dp {self.dp_size} x pp {self.pp_size}; "
            f"ep {self.ep_size} x etp {self.expert_tp_size} x expert-dp {self.expert_dp_size}"
        )

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def gather_from_all(self, value: Any) -> list[Any]:
        """Every rank's `value` (a small picklable object), in rank order, on every rank."""
        if self.world_size == 1:
            return [value]
        values: list[Any] = [None] * self.world_size
        dist.all_gather_object(values, value)
        return values


@dataclass(frozen=True)
class RankLayout:
    """Every group of each kind as tuples of global ranks, in creation order. Each kind except
    `embedding` partitions the world; `embedding` is empty without pipeline parallelism."""

    tp: Groups
    dp: Groups
    pp: Groups
    embedding: Groups
    stage: Groups
    expert_tp: Groups
    ep: Groups
    expert_dp: Groups


def check_parallel_sizes(
    world_size: int, tp_size: int = 1, pp_size: int = 1, ep_size: int = 1, expert_tp_size: int = 1
) -> None:
    """Raise a ConfigError unless the parallel sizes tile `world_size` ranks."""
    flags = {
        "--tensor-model-parallel-size": tp_size,
        "--pipeline-model-parallel-size": pp_size,
        "--moe-expert-parallel-size": ep_size,
        "--expert-tensor-parallel-size": expert_tp_size,
    }
    for flag, size in flags.items():
        if size < 1:
            raise ConfigError(f"{flag} {size} is not a parallel size; give a positive number of ranks")
    if world_size % (tp_size * pp_size):
        raise ConfigError(
            f"--tensor-model-parallel-size {tp_size} x --pipeline-model-parallel-size {pp_size} does not divide "
            f"the {world_size} ranks; choose sizes whose product divides the number of processes"
        )
    stage_size = world_size // pp_size
    if stage_size % (ep_size * expert_tp_size):
        raise ConfigError(
            f"--moe-expert-parallel-size {ep_size} x --expert-tensor-parallel-size {expert_tp_size} does not "
            f"divide the {stage_size} ranks of a pipeline stage; choose sizes whose product divides "
            "the number of processes divided by the pipeline-parallel size"
        )


def _axis_groups(shape: tuple[int, ...], axis: int) -> Groups:
    """The groups of ranks that differ only along `axis` of a grid whose first axis varies fastest."""
    stride, size = math.prod(shape[:axis]), shape[axis]
    starts = [rank for rank in range(math.prod(shape)) if (rank // stride) % size == 0]
    return tuple(tuple(range(start, start + size * stride, stride)) for start in starts)


def rank_layout(
    world_size: int, tp_size: int = 1, pp_size: int = 1, ep_size: int = 1, expert_tp_size: int = 1
) -> RankLayout:
    """Every process group of the grid, computed without torch.distributed."""
    check_parallel_sizes(world_size, tp_size, pp_size, ep_size, expert_tp_size)
    dp_size = world_size // (tp_size * pp_size)
    dense = (tp_size, dp_size, pp_size)
    experts = (expert_tp_size, ep_size, world_size // (pp_size * ep_size * expert_tp_size), pp_size)
    pp = _axis_groups(dense, 2)
    return RankLayout(
        tp=_axis_groups(dense, 0),
        dp=_axis_groups(dense, 1),
        pp=pp,
        embedding=tuple((ranks[0], ranks[-1]) for ranks in pp) if pp_size > 1 else (),
        stage=tuple(
            tuple(range(first, first + world_size // pp_size)) for first in range(0, world_size, world_size // pp_size)
        ),
        expert_tp=_axis_groups(experts, 0),
        ep=_axis_groups(experts, 1),
        expert_dp=_axis_groups(experts, 2),
    )


def position_in(groups: Groups, rank: int) -> int:
    """`rank`'s index inside the one group of `groups` that holds it."""
    return next(ranks.index(rank) for ranks in groups if rank in ranks)


def is_parallel(group: dist.ProcessGroup | None) -> bool:
    """Whether a collective over `group` has anyone to talk to."""
    return group is not None and dist.get_world_size(group) > 1


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """Sum `tensor` in place over `group`; nothing to do without one or with a single rank."""
    if is_parallel(group):
        comm.all_reduce(tensor, group=group)


def free_port() -> int:
    """A TCP port free on this host now, for a rendezvous (torchrun's --master-port, a spawned world)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def single_process_grid(device: torch.device | None = None) -> ParallelGrid:
    return ParallelGrid(1, 0, 1, 0, None, device or default_device())


def launched_world_size(ep_size: int = 1, *, tp_size: int = 1, pp_size: int = 1, expert_tp_size: int = 1) -> int:
    """The number of processes torchrun started (1 without it), checked against the parallel sizes."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    check_parallel_sizes(world_size, tp_size, pp_size, ep_size, expert_tp_size)
    return world_size


def _own_group(groups: Groups, rank: int) -> dist.ProcessGroup | None:
    """Create every group of one kind and return the one holding `rank` (None if none does)."""
    own = None
    for ranks in groups:  # new_group is collective: every rank creates every group, in the same order
        group = dist.new_group(list(ranks))
        if rank in ranks:
            own = group
    return own


def build_parallel_grid(
    device: torch.device | None = None, ep_size: int = 1, tp_size: int = 1, pp_size: int = 1, expert_tp_size: int = 1
) -> ParallelGrid:
    """Initialise torch.distributed from torchrun's environment (if any) and build the groups."""
    device = device or default_device()
    world_size = launched_world_size(ep_size, tp_size=tp_size, pp_size=pp_size, expert_tp_size=expert_tp_size)
    if world_size == 1 and not dist.is_initialized():
        return single_process_grid(device)
    if not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    layout = rank_layout(world_size, tp_size, pp_size, ep_size, expert_tp_size)
    dp_size = world_size // (tp_size * pp_size)
    # Data parallelism over every rank reuses the world group rather than a second communicator.
    dp_group = dist.group.WORLD if dp_size == world_size else _own_group(layout.dp, rank)
    tp_group, pp_group = _own_group(layout.tp, rank), _own_group(layout.pp, rank)
    embedding_group = _own_group(layout.embedding, rank)
    stage_group = dp_group if tp_size == 1 else dist.group.WORLD if pp_size == 1 else _own_group(layout.stage, rank)
    expert_tp_group, ep_group = _own_group(layout.expert_tp, rank), _own_group(layout.ep, rank)
    expert_dp_group = _own_group(layout.expert_dp, rank)
    return ParallelGrid(
        world_size,
        rank,
        dp_size,
        position_in(layout.dp, rank),
        dp_group,
        device,
        ep_size=ep_size,
        ep_rank=position_in(layout.ep, rank),
        ep_group=ep_group,
        expert_dp_size=len(layout.expert_dp[0]),
        expert_dp_rank=position_in(layout.expert_dp, rank),
        expert_dp_group=expert_dp_group,
        tp_size=tp_size,
        tp_rank=position_in(layout.tp, rank),
        tp_group=tp_group,
        pp_size=pp_size,
        pp_rank=position_in(layout.pp, rank),
        pp_group=pp_group,
        expert_tp_size=expert_tp_size,
        expert_tp_rank=position_in(layout.expert_tp, rank),
        expert_tp_group=expert_tp_group,
        embedding_group=embedding_group,
        stage_group=stage_group,
    )
