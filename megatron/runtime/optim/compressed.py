"""What DeepSpeed's communication-compressed optimizers (1-bit Adam, 0/1 Adam, 1-bit LAMB) share:
the engine leaves the gradients of some steps unreduced, and the optimizer averages a tensor of its
own (a momentum, a gradient, an accumulated update) over the replicas of the parameters it belongs
to by the 1-bit compressed all-reduce (megatron/comm/onebit.py), with an error-feedback buffer per
averaged tensor that carries what compression dropped into the next call.

Experts' tensors are averaged over their expert-data-parallel group, the rest over data
parallelism. The error buffers, and any tensor that differs between replicas, go into each rank's
own checkpoint file (megatron/runtime/optim/rank_own_state.py) so that a resumed run continues
exactly."""

from collections.abc import Iterable
from typing import Any, TypedDict, Unpack

import torch
import torch.distributed as dist

from megatron.comm.onebit import ErrorFeedback, compressed_allreduce, padded_numel
from megatron.parallel import ParallelGrid, is_parallel
from megatron.placement import placement_of


class AdamParams(TypedDict, total=False):
    """The parameters every 1-bit optimizer takes, DeepSpeed's names and defaults."""

    lr: float  # 1e-3
    betas: tuple[float, float]  # (0.9, 0.999)
    eps: float  # 1e-8
    weight_decay: float  # 0
    # DeepSpeed's 1-bit optimizers ignore bias_correction (their updates have none), and
    # cuda_aware / comm_backend_name choose its transport: torch.distributed's carries them here
    bias_correction: bool
    cuda_aware: bool
    comm_backend_name: str


class CompressedOptimizer(torch.optim.Optimizer):
    def __init__(
        self,
        params: Iterable[Any],
        grid: ParallelGrid | None,
        group_defaults: dict[str, Any] | None = None,
        **adam: Unpack[AdamParams],
    ) -> None:
        """`group_defaults`: settings of the optimizer's own kept per parameter group besides Adam's."""
        defaults = dict(
            lr=adam.get("lr", 1e-3),
            betas=tuple(adam.get("betas", (0.9, 0.999))),
            eps=adam.get("eps", 1e-8),
            weight_decay=adam.get("weight_decay", 0.0),
            **(group_defaults or {}),
        )
        super().__init__(params, defaults)
        self.grid = grid
        # one error-feedback pair per averaged buffer, keyed by the parameter it belongs to (1-bit
        # LAMB's one buffer of a replica group's momenta: by the group's first parameter)
        self.errors: dict[torch.Tensor, ErrorFeedback] = {}

    @property
    def reduces_gradients(self) -> bool:
        """Whether the engine all-reduces this step's gradients as usual (else each rank's own go in)."""
        raise NotImplementedError

    def first_state(self) -> dict[str, torch.Tensor] | None:
        """The first parameter's state (its counters are every parameter's), None before any step."""
        return next((self.state[p] for group in self.param_groups for p in group["params"] if p in self.state), None)

    @property
    def steps_taken(self) -> int:
        first = self.first_state()
        return 0 if first is None else int(first["step"])

    def replica_group(self, param: torch.Tensor) -> dist.ProcessGroup | None:
        return None if self.grid is None else placement_of(param).replica_group(self.grid)

    def compressed_mean(self, key: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        """The mean of the 1-D `flat` over the replicas of parameter `key` through 1-bit compression
        with `key`'s error feedback; `flat` itself where `key` has no replicas."""
        group = self.replica_group(key)
        if not is_parallel(group):
            return flat
        ranks, numel = dist.get_world_size(group), flat.numel()
        padded = padded_numel(numel, ranks)
        if key not in self.errors:
            self.errors[key] = ErrorFeedback.zeros(padded, ranks, flat.device)
        buffer = torch.zeros(padded, dtype=torch.float32, device=flat.device)
        buffer[:numel] = flat
        return compressed_allreduce(buffer, self.errors[key], group)[:numel]

    def averaged_numel(self, key: torch.Tensor) -> int:
        """The elements of the buffer averaged under `key` (a parameter's own: its size)."""
        return key.numel()

    def replica_local(self) -> dict[torch.Tensor, dict[str, torch.Tensor]]:
        """Tensors that differ between a parameter's replicas besides the error buffers, by
        parameter and name (0/1 Adam's local steps); checkpointed per rank as the errors are."""
        return {}

    def print_once(self, message: str) -> None:
        if self.grid is None or self.grid.is_first_rank:
            print(f" > {type(self).__name__}: {message}", flush=True)
