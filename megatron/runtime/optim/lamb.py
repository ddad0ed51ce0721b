"""LAMB (You et al., 2019) as DeepSpeed's `"type": "Lamb"` defines it: an Adam step with decoupled
weight decay, scaled per tensor by the trust ratio ||w|| / ||update||, clamped to
[min_coeff, max_coeff] (1 where either norm is zero).
"""

from collections.abc import Iterable
from typing import Any

import torch

from megatron.runtime.optim.adam_state import adam_state


class Lamb(torch.optim.Optimizer):
    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
    ) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0 or not 0 <= betas[0] < 1 or not 0 <= betas[1] < 1:
            raise ValueError(
                f"Lamb needs lr, eps, weight_decay >= 0 and betas in [0, 1), got lr={lr}, "
                f"eps={eps}, weight_decay={weight_decay}, betas={betas}"
            )
        if not 0 < min_coeff <= max_coeff:
            raise ValueError(f"Lamb needs 0 < min_coeff <= max_coeff, got {min_coeff} and {max_coeff}")
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            max_coeff=max_coeff,
            min_coeff=min_coeff,
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = adam_state(self, param)
                state["step"] += 1
                step = int(state["step"])
                grad, exp_avg, exp_avg_sq = param.grad, state["exp_avg"], state["exp_avg_sq"]
                exp_avg.lerp_(grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                first, second = ((1 - beta1**step), (1 - beta2**step)) if group["bias_correction"] else (1.0, 1.0)
                update = (exp_avg / first) / ((exp_avg_sq / second).sqrt_().add_(group["eps"]))
                if group["weight_decay"]:
                    update.add_(param, alpha=group["weight_decay"])
                trust = trust_ratio(param, update, group["min_coeff"], group["max_coeff"])
                param.add_(update, alpha=-group["lr"] * trust)
        return loss


def trust_ratio(param: torch.Tensor, update: torch.Tensor, min_coeff: float, max_coeff: float) -> float:
    """||w|| / ||update|| clamped to [min_coeff, max_coeff]; 1 where either norm is zero."""
    weight_norm, update_norm = param.norm(), update.norm()
    if weight_norm > 0 and update_norm > 0:
        return float((weight_norm / update_norm).clamp(min_coeff, max_coeff))
    return 1.0
