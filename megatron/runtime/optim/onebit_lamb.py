"""DeepSpeed's 1-bit LAMB (Li et al. 2021, `"type": "OneBitLamb"`): LAMB without bias correction
for the first `freeze_step` steps on all-reduced gradients, keeping a running average (`coeff_beta`)
of each tensor's trust ratio; then the engine stops reducing gradients and every rank's momenta of
its own gradients are averaged as one buffer per replica group by the 1-bit compressed all-reduce.

In the compression stage each momentum is first scaled so that all have the same RMS (the scales
are fixed at the first compressed step: compression shares one scale per chunk, and a tensor of
small momenta would otherwise be lost under large ones). The variance used by the update stays
frozen; a fresh one is kept from the gradients reconstructed from the averaged momenta, and the
frozen trust ratio is multiplied by a factor, the largest ratio of the frozen to the fresh
denominator, clamped to [factor_min, factor_max] and to within factor_threshold of its last
value. Experts' momenta are averaged over their expert-data-parallel group, the rest over data
parallelism, one buffer for each (the scales too are equalised within each)."""

from collections.abc import Iterable
from typing import Any, Unpack

import torch

from megatron.parallel import ParallelGrid
from megatron.placement import expert_ids
from megatron.runtime.optim.adam_state import adam_state
from megatron.runtime.optim.compressed import AdamParams, CompressedOptimizer
from megatron.runtime.optim.lamb import trust_ratio


class OneBitLamb(CompressedOptimizer):
    def __init__(
        self,
        params: Iterable[Any],
        freeze_step: int = 100000,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        coeff_beta: float = 0.9,
        factor_max: float = 4.0,
        factor_min: float = 0.5,
        factor_threshold: float = 0.1,
        grid: ParallelGrid | None = None,
        **adam: Unpack[AdamParams],
    ) -> None:
        super().__init__(params, grid, dict(max_coeff=max_coeff, min_coeff=min_coeff), **adam)
        self.freeze_step = freeze_step
        self.coeff_beta = coeff_beta
        self.factor_max, self.factor_min, self.factor_threshold = factor_max, factor_min, factor_threshold
        self.lamb_coeffs: list[float] = []

    @property
    def reduces_gradients(self) -> bool:
        return self.steps_taken < self.freeze_step

    def get_lamb_coeffs(self) -> list[float]:
        """The last step's trust ratio of each tensor, as DeepSpeed's OnebitLamb reports them."""
        return self.lamb_coeffs

    def _state(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        state = adam_state(self, param)
        if "exp_avg_sq_fresh" not in state:
            state["exp_avg_sq_fresh"] = torch.zeros_like(param)
            state["lamb_coeff_freeze"] = torch.zeros(())
            state["last_factor"] = torch.ones(())
        return state

    def _buffers(self) -> dict[torch.Tensor, list[torch.Tensor]]:
        """The parameters averaged together, by the first of them: the dense ones, the experts."""
        buffers: dict[bool, list[torch.Tensor]] = {}
        for group in self.param_groups:
            for param in group["params"]:
                buffers.setdefault(expert_ids(param) is not None, []).append(param)
        return {params[0]: params for params in buffers.values()}

    def averaged_numel(self, key: torch.Tensor) -> int:
        return sum(param.numel() for param in self._buffers()[key])

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        self.lamb_coeffs = []
        compressing = not self.reduces_gradients
        if compressing and self.steps_taken == self.freeze_step:
            self.print_once(f"compressed communication from step {self.steps_taken + 1}")
        if compressing:
            self._compressed_step()
            return
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self._state(param)
                grad = param.grad
                state["exp_avg"].mul_(beta1).add_(grad, alpha=1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                state["step"] += 1
                if int(state["step"]) == self.freeze_step:
                    state["exp_avg_sq_fresh"].copy_(state["exp_avg_sq"])
                update = state["exp_avg"] / (state["exp_avg_sq"].sqrt() + group["eps"])
                if group["weight_decay"] > 0:
                    update.add_(param, alpha=group["weight_decay"])
                coeff = trust_ratio(param, update, group["min_coeff"], group["max_coeff"])
                if coeff != 1.0:
                    frozen = state["lamb_coeff_freeze"]
                    frozen.copy_(self.coeff_beta * frozen + (1 - self.coeff_beta) * coeff)
                self.lamb_coeffs.append(coeff)
                param.add_(update, alpha=-group["lr"] * coeff)

    def _scaling(self, params: list[torch.Tensor]) -> None:
        """Each momentum's scale to the buffer's mean RMS, fixed at the first compressed step."""
        if "scaling_coeff" in self.state[params[0]]:
            return
        rms = [float(self.state[p]["exp_avg"].norm()) / p.numel() ** 0.5 for p in params]
        united = sum(rms) / len(rms)
        for param, own in zip(params, rms):
            self.state[param]["scaling_coeff"] = torch.tensor(united / own if own > 0 else 1.0)

    def _compressed_step(self) -> None:
        groups = {param: group for group in self.param_groups for param in group["params"]}
        for key, params in self._buffers().items():
            self._scaling(params)
            last = {}
            for param in params:
                state = self._state(param)
                beta1 = groups[param]["betas"][0]
                last[param] = state["exp_avg"].clone()
                grad = param.grad if param.grad is not None else torch.zeros_like(param)
                state["exp_avg"].mul_(beta1).add_(grad, alpha=1 - beta1).mul_(state["scaling_coeff"])
            flat = torch.cat([self.state[p]["exp_avg"].reshape(-1) for p in params])
            averaged = self.compressed_mean(key, flat)
            for param, piece in zip(params, averaged.split([p.numel() for p in params])):
                state = self.state[param]
                state["exp_avg"].copy_(piece.view_as(param)).div_(state["scaling_coeff"])
                self._frozen_lamb_update(param, state, groups[param], last[param])

    def _frozen_lamb_update(
        self, param: torch.Tensor, state: dict[str, torch.Tensor], group: dict[str, Any], last_exp_avg: torch.Tensor
    ) -> None:
        beta1, beta2 = group["betas"]
        exp_avg, fresh = state["exp_avg"], state["exp_avg_sq_fresh"]
        reconstructed = (exp_avg - beta1 * last_exp_avg) / (1 - beta1)
        fresh.mul_(beta2).addcmul_(reconstructed, reconstructed, value=1 - beta2)
        denominator = state["exp_avg_sq"].sqrt() + group["eps"]
        plain = exp_avg / denominator
        update = plain + group["weight_decay"] * param if group["weight_decay"] > 0 else plain
        factor = float((denominator / (fresh.sqrt() + group["eps"])).max())
        if group["weight_decay"] > 0:
            ratio = min(1.0, float(plain.norm() / update.norm()))
            factor = factor * ratio + (1.0 - ratio)
        last = float(state["last_factor"])
        factor = min(max(factor, self.factor_min), self.factor_max)
        factor = min(max(factor, last * (1.0 - self.factor_threshold)), last * (1.0 + self.factor_threshold))
        state["last_factor"].fill_(factor)
        coeff = float(state["lamb_coeff_freeze"]) * factor
        self.lamb_coeffs.append(coeff)
        param.add_(update, alpha=-group["lr"] * coeff)
        state["step"] += 1
