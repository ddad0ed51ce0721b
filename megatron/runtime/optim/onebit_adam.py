"""DeepSpeed's 1-bit Adam (Tang et al. 2021, `"type": "OneBitAdam"`): Adam for the first
`freeze_step` steps on gradients the engine all-reduces as usual; then the variance is frozen, the
engine stops reducing gradients, and each rank's momentum of its own gradients is averaged over
the parameter's data-parallel group by the 1-bit compressed all-reduce (megatron/comm/onebit.py),
one call per parameter as DeepSpeed makes them, with each parameter's worker and server errors.

The update is DeepSpeed's: m / (sqrt(v) + eps), plus weight_decay x p, times lr, with no bias
correction. Experts' momenta are averaged over their expert-data-parallel group, the rest over
data parallelism."""

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from megatron.comm.onebit import ErrorFeedback, compressed_allreduce, padded_numel
from megatron.parallel import ParallelGrid, is_parallel
from megatron.placement import placement_of
from megatron.runtime.optim.adam_state import adam_state


class OneBitAdam(torch.optim.Optimizer):
    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        freeze_step: int = 100000,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        bias_correction: bool = True,
        cuda_aware: bool = False,
        comm_backend_name: str = "nccl",
        grid: ParallelGrid | None = None,
    ) -> None:
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.freeze_step = freeze_step
        self.grid = grid
        # each parameter's error feedback, kept out of the checkpointed state: as DeepSpeed does, a
        # loaded run starts them at zero (each rank's differ, and they fit only the same ranks)
        self.errors: dict[torch.Tensor, ErrorFeedback] = {}
        self.announced = False
        # cuda_aware and comm_backend_name pick DeepSpeed's transport, bias_correction it ignores too:
        # torch.distributed carries the exchanges here, and the update has no bias correction

    @property
    def compressing(self) -> bool:
        """Past the warm-up: the engine leaves gradients unreduced and the momentum is compressed."""
        return self.steps_taken >= self.freeze_step

    @property
    def steps_taken(self) -> int:
        first = next((self.state[p] for group in self.param_groups for p in group["params"] if p in self.state), None)
        return 0 if first is None else int(first["step"])

    def _group_of(self, param: torch.Tensor) -> dist.ProcessGroup | None:
        return None if self.grid is None else placement_of(param).replica_group(self.grid)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        compressing = self.compressing
        if compressing and not self.announced:
            self.announced = True
            if self.grid is None or self.grid.is_first_rank:
                print(
                    f" > OneBitAdam: compressed communication from step {self.steps_taken + 1} "
                    "(error feedback from zero: after a resume too, as in DeepSpeed)",
                    flush=True,
                )
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = adam_state(self, param)
                grad, exp_avg = param.grad, state["exp_avg"]
                exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
                if compressing:
                    self._average_momentum(param, state)
                else:
                    state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                update = exp_avg / (state["exp_avg_sq"].sqrt() + group["eps"])
                if group["weight_decay"] > 0:
                    update.add_(param, alpha=group["weight_decay"])
                param.add_(update, alpha=-group["lr"])
                state["step"] += 1

    def _average_momentum(self, param: torch.Tensor, state: dict[str, torch.Tensor]) -> None:
        group = self._group_of(param)
        if not is_parallel(group):
            return
        ranks = dist.get_world_size(group)
        numel = param.numel()
        padded = padded_numel(numel, ranks)
        if param not in self.errors:
            self.errors[param] = ErrorFeedback.zeros(padded, ranks, param.device)
        buffer = torch.zeros(padded, dtype=torch.float32, device=param.device)
        buffer[:numel] = state["exp_avg"].reshape(-1)
        averaged = compressed_allreduce(buffer, self.errors[param], group)
        state["exp_avg"].copy_(averaged[:numel].view_as(param))
