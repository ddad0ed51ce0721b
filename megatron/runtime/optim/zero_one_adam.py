"""DeepSpeed's 0/1 Adam (Lu et al. 2022, `"type": "ZeroOneAdam"`): Adam whose variance is updated
ever more rarely and whose replicas synchronise ever more rarely, with 1-bit compression for what
they do exchange.

- Up to `var_freeze_step`: the variance is updated on steps whose number is a multiple of an
  interval that starts at 1 and doubles after every `var_update_scaler` updates; only those steps'
  gradients are all-reduced by the engine. On the others each rank's gradient is averaged by the
  1-bit compressed all-reduce and only the momentum moves.
- After it (the variance frozen, the error buffers restarted): each rank steps alone on its own
  gradients and sums its updates; every `local_step_interval` steps (1, doubling after every
  `local_step_scaler` local steps, at most `local_step_clipper`) the replicas average their summed
  updates (scaled back to momentum units by sqrt(v) + eps) by the compressed all-reduce, apply that
  mean to the point they last shared and take the momentum from it.

DeepSpeed sums the local updates and subtracts the sum to undo them; that is exact only to the
round-off of the largest update, which for parameters whose variance is near zero (a key bias,
whose gradient is round-off) parted the replicas by 2**-16. Here each rank keeps the shared point
itself (`anchor`, the same size as DeepSpeed's accumulator) and the summed update is the distance
from it, so every replica lands on the same bits. Between synchronisations the replicas'
parameters and momenta differ, so those go into each rank's own checkpoint file with the errors
(replica_local). The update is DeepSpeed's:
m / (sqrt(v) + eps) + weight_decay x p, times lr, without bias correction. Unlike DeepSpeed's,
the first step updates the parameters (DeepSpeed's first call only sets up its buffers)."""

from collections.abc import Iterable
from typing import Any, Unpack

import torch

from megatron.errors import CheckpointError
from megatron.parallel import ParallelGrid
from megatron.runtime.optim.adam_state import adam_state
from megatron.runtime.optim.compressed import AdamParams, CompressedOptimizer

# the interval bookkeeping, the same in every parameter's state (as DeepSpeed keeps it), as tensors
# so that checkpoints hold it
_COUNTERS = ("var_interval", "var_counter", "local_step_interval", "local_step_counter", "lrs")


def _counters_on_the_host(optimizer: torch.optim.Optimizer) -> None:
    """torch's load puts every state value on its parameter's device and dtype; the counters are read
    on every step of every parameter, so they go back to the host as float32 (reading one from a GPU
    would wait for the device each time)."""
    for state in optimizer.state.values():
        for key in _COUNTERS:
            if key in state:
                state[key] = state[key].to("cpu", torch.float32)


class ZeroOneAdam(CompressedOptimizer):
    def __init__(
        self,
        params: Iterable[Any],
        var_freeze_step: int = 100000,
        var_update_scaler: int = 16,
        local_step_scaler: int = 32678,
        local_step_clipper: int = 16,
        grid: ParallelGrid | None = None,
        **adam: Unpack[AdamParams],
    ) -> None:
        super().__init__(params, grid, **adam)
        self.var_freeze_step = var_freeze_step
        self.var_update_scaler = var_update_scaler
        self.local_step_scaler = local_step_scaler
        self.local_step_clipper = local_step_clipper
        self.register_load_state_dict_post_hook(_counters_on_the_host)

    def _state(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        state = adam_state(self, param)
        if "momentum_accumulator" in state:  # 54b3a75's checkpoints kept each rank's summed updates
            if float(state["lrs"]) > 0:
                raise CheckpointError(
                    "this 0/1 Adam checkpoint was saved between two synchronisations by an older version, which "
                    "kept no shared point to resume from; resume from one saved at a synchronisation step"
                )
            state["anchor"] = state.pop("momentum_accumulator")
        if "anchor" not in state:
            state.update({key: torch.zeros(()) for key in _COUNTERS})
            state["var_interval"].fill_(1)
            state["local_step_interval"].fill_(1)
            state["anchor"] = torch.zeros_like(param)
        return state

    def _counter(self, key: str, default: int) -> int:
        first = self.first_state()
        return default if first is None or key not in first else int(first[key])

    @property
    def frozen(self) -> bool:
        """Past `var_freeze_step`: local steps with periodic compressed synchronisation."""
        return self.steps_taken > self.var_freeze_step

    @property
    def reduces_gradients(self) -> bool:
        return not self.frozen and (self.steps_taken + 1) % self._counter("var_interval", 1) == 0

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        frozen = self.frozen
        if frozen and self.steps_taken == self.var_freeze_step + 1:
            self.errors.clear()  # they held gradients' errors; from here on they hold updates'
            self.print_once(f"variance frozen: local steps from step {self.steps_taken + 1}")
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    self._step_one(param, self._state(param), group, frozen)

    def _step_one(
        self, param: torch.Tensor, state: dict[str, torch.Tensor], group: dict[str, Any], frozen: bool
    ) -> None:
        beta1, beta2 = group["betas"]
        lr, eps, exp_avg, exp_avg_sq = group["lr"], group["eps"], state["exp_avg"], state["exp_avg_sq"]
        state["step"] += 1
        step, grad = int(state["step"]), param.grad
        variance_step = not frozen and step % int(state["var_interval"]) == 0
        if frozen:
            if float(state["lrs"]) == 0:  # an interval begins where the replicas are equal
                state["anchor"].copy_(param)
            exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
            state["lrs"] += lr
        elif variance_step:  # the engine all-reduced this step's gradients
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
        else:
            averaged = self.compressed_mean(param, grad.reshape(-1)).view_as(param)
            exp_avg.mul_(beta1).add_(averaged, alpha=1 - beta1)
        update = exp_avg / (exp_avg_sq.sqrt() + eps)
        if group["weight_decay"] > 0:
            update.add_(param, alpha=group["weight_decay"])
        param.add_(update, alpha=-lr)
        if frozen:
            self._local_step(param, state, eps, step)
        elif variance_step:
            state["var_counter"] += 1
            if int(state["var_counter"]) == self.var_update_scaler:
                state["var_counter"].zero_()
                state["var_interval"] *= 2

    def _local_step(
        self,
        param: torch.Tensor,
        state: dict[str, torch.Tensor],
        eps: float,
        step: int,
    ) -> None:
        """At an interval's end replace the replicas' local steps by their compressed mean."""
        if step % int(state["local_step_interval"]) == 0:
            anchor, denominator = state["anchor"], state["exp_avg_sq"].sqrt() + eps
            summed = (param - anchor).mul_(denominator)
            mean = self.compressed_mean(param, summed.reshape(-1)).view_as(param)
            state["exp_avg"].copy_(mean / -state["lrs"])
            param.copy_(anchor + mean / denominator)
            state["lrs"].zero_()
        state["local_step_counter"] += 1
        if int(state["local_step_counter"]) == self.local_step_scaler:
            state["local_step_counter"].zero_()
            state["local_step_interval"].copy_(
                torch.clamp(state["local_step_interval"] * 2, max=self.local_step_clipper)
            )

    def replica_local(self) -> dict[torch.Tensor, dict[str, torch.Tensor]]:
        if not self.frozen:
            return {}
        return {
            param: {"param": param.data, "exp_avg": state["exp_avg"]}
            for param, state in self.state.items()
            if "anchor" in state
        }
