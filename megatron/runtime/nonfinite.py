"""Which ranks saw a NaN or an infinity in a step, agreed over the world in one small all-reduce."""

from dataclasses import dataclass

import torch

from megatron import comm
from megatron.parallel import ParallelGrid


@dataclass(frozen=True)
class NonFiniteStep:
    """An optimizer step whose loss or gradients held a NaN or an infinity, and on which ranks."""

    loss_ranks: list[int]
    grad_ranks: list[int]

    def describe(self) -> str:
        parts = [
            f"the {what} is not finite on rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))}"
            for what, ranks in (("loss", self.loss_ranks), ("gradient norm", self.grad_ranks))
            if ranks
        ]
        return " and ".join(parts)


def nonfinite_ranks(
    loss_nonfinite: torch.Tensor, grads_nonfinite: bool, norm_finite: bool, grid: ParallelGrid
) -> NonFiniteStep | None:
    """Which ranks saw a non-finite loss (`loss_nonfinite`, this rank's flag over the accumulation,
    cleared here) or gradients, or None when none did and the global norm is finite."""
    world, rank = grid.world_size, grid.rank
    flags = torch.zeros(2 * world, device=grid.device)
    flags[2 * rank] = loss_nonfinite.float()
    flags[2 * rank + 1] = float(grads_nonfinite)
    if world > 1:
        comm.all_reduce(flags)
    loss_nonfinite.zero_()
    loss_ranks, grad_ranks = (torch.nonzero(flags[k::2]).flatten().tolist() for k in (0, 1))
    if not norm_finite and not grad_ranks:  # finite shares whose squares overflow together
        grad_ranks = list(range(world))
    return NonFiniteStep(loss_ranks, grad_ranks) if loss_ranks or grad_ranks else None
