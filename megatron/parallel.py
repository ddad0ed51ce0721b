"""The rank grid: world, data-parallel and expert-parallel groups and the device, built once and
passed down.

Every rank is data-parallel for dense parameters. Experts are split over expert-parallel (EP)
groups of consecutive ranks; the copies of one expert live on the strided expert-data-parallel
group (ranks with the same position in their EP group). Launched by torchrun (WORLD_SIZE set),
torch.distributed is initialised with gloo on the CPU or NCCL on CUDA; launched as plain
`python`, everything is single-process and no group exists.
"""

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron.errors import ConfigError


@dataclass(frozen=True)
class ParallelGrid:
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

    @property
    def is_first_rank(self) -> bool:
        return self.rank == 0

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


def is_parallel(group: dist.ProcessGroup | None) -> bool:
    """Whether a collective over `group` has anyone to talk to."""
    return group is not None and dist.get_world_size(group) > 1


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """Sum `tensor` in place over `group`; nothing to do without one or with a single rank."""
    if is_parallel(group):
        dist.all_reduce(tensor, group=group)


def default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def single_process_grid(device: torch.device | None = None) -> ParallelGrid:
    return ParallelGrid(1, 0, 1, 0, None, device or default_device())


def launched_world_size(ep_size: int = 1) -> int:
    """The number of processes torchrun started (1 without it), checked against the expert-parallel size."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size % ep_size:
        raise ConfigError(
            f"--moe-expert-parallel-size {ep_size} does not divide the {world_size} ranks; "
            "choose an expert-parallel size that divides the number of processes"
        )
    return world_size


def build_parallel_grid(device: torch.device | None = None, ep_size: int = 1) -> ParallelGrid:
    """Initialise torch.distributed from torchrun's environment (if any) and build the groups."""
    device = device or default_device()
    world_size = launched_world_size(ep_size)
    if world_size == 1 and not dist.is_initialized():
        return single_process_grid(device)
    if not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    ep_group = expert_dp_group = None
    for first in range(0, world_size, ep_size):  # every rank must create every group
        group = dist.new_group(list(range(first, first + ep_size)))
        if first <= rank < first + ep_size:
            ep_group = group
    for offset in range(ep_size):
        group = dist.new_group(list(range(offset, world_size, ep_size)))
        if rank % ep_size == offset:
            expert_dp_group = group
    return ParallelGrid(
        world_size, rank, world_size, rank, dist.group.WORLD, device,
        ep_size=ep_size, ep_rank=rank % ep_size, ep_group=ep_group,
        expert_dp_size=world_size // ep_size, expert_dp_rank=rank // ep_size, expert_dp_group=expert_dp_group,
    )
