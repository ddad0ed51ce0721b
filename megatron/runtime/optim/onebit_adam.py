"""DeepSpeed's 1-bit Adam (Tang et al. 2021, `"type": "OneBitAdam"`): Adam for the first
`freeze_step` steps on gradients the engine all-reduces as usual; then the variance is frozen, the
engine stops reducing gradients, and each rank's momentum of its own gradients is averaged over
the parameter's replicas by the 1-bit compressed all-reduce, one call per parameter as DeepSpeed
makes them, with each parameter's worker and server errors.

The update is DeepSpeed's: m / (sqrt(v) + eps), plus weight_decay x p, times lr, with no bias
correction."""

from collections.abc import Iterable
from typing import Any, Unpack

import torch

from megatron.parallel import ParallelGrid
from megatron.runtime.optim.adam_state import adam_state
from megatron.runtime.optim.compressed import AdamParams, CompressedOptimizer


class OneBitAdam(CompressedOptimizer):
    def __init__(
        self,
        params: Iterable[Any],
        freeze_step: int = 100000,
        grid: ParallelGrid | None = None,
        **adam: Unpack[AdamParams],
    ) -> None:
        super().__init__(params, grid, **adam)
        self.freeze_step = freeze_step
        self.announced = False

    @property
    def reduces_gradients(self) -> bool:
        return self.steps_taken < self.freeze_step

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        compressing = not self.reduces_gradients
        if compressing and not self.announced:
            self.announced = True
            self.print_once(f"compressed communication from step {self.steps_taken + 1}")
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = adam_state(self, param)
                grad, exp_avg = param.grad, state["exp_avg"]
                exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
                if compressing:
                    exp_avg.copy_(self.compressed_mean(param, exp_avg.reshape(-1)).view_as(param))
                else:
                    state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                update = exp_avg / (state["exp_avg_sq"].sqrt() + group["eps"])
                if group["weight_decay"] > 0:
                    update.add_(param, alpha=group["weight_decay"])
                param.add_(update, alpha=-group["lr"])
                state["step"] += 1
