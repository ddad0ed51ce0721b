"""The rank grid: world, data-parallel group and device, built once and passed down.

Launched by torchrun (WORLD_SIZE set), torch.distributed is initialised with gloo on the CPU or
NCCL on CUDA; launched as plain `python`, everything is single-process and no group exists.
"""

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelGrid:
    world_size: int
    rank: int
    dp_size: int
    dp_rank: int
    dp_group: dist.ProcessGroup | None
    device: torch.device

    @property
    def is_first_rank(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()


def default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def build_parallel_grid(device: torch.device | None = None) -> ParallelGrid:
    """Initialise torch.distributed from torchrun's environment (if any) and build the grid."""
    device = device or default_device()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1 and not dist.is_initialized():
        return ParallelGrid(1, 0, 1, 0, None, device)
    if not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    return ParallelGrid(world_size, rank, world_size, rank, dist.group.WORLD, device)
