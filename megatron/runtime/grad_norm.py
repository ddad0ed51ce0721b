"""The global gradient norm under every layout: tensor-parallel slices summed over their group,
whole copies counted once, experts over the expert groups, pipeline stages added up."""

import torch

from megatron.parallel import ParallelGrid, all_reduce
from megatron.placement import SLICE, WHOLE
from megatron.runtime.strategy import TrainingStrategy


def _sq_norm(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    if not grads:
        return torch.zeros((), device=device)
    return torch.nn.utils.get_total_norm(grads, foreach=True).float().square()


def _model_parallel_sq_norm(
    grads: list[torch.Tensor], kinds: list[str], tp_rank: int, device: torch.device
) -> torch.Tensor:
    # tensor-parallel slices add up over the group; a gradient every tensor-parallel rank holds
    # whole counts once, a pipeline stage's copy of the first stage's parameter not at all
    sq = _sq_norm([g for g, kind in zip(grads, kinds) if kind == SLICE], device)
    return sq + _sq_norm([g for g, kind in zip(grads, kinds) if kind == WHOLE], device) if tp_rank == 0 else sq


def global_sq_norm(
    dense_grads: list[torch.Tensor], expert_grads: list[torch.Tensor], strategy: TrainingStrategy, grid: ParallelGrid
) -> tuple[float, bool]:
    """Squared norm of all gradients of the model, and whether this rank's own share of them
    is non-finite. Each expert lives on one rank of the expert-parallel group; dense gradients
    are replicated, or under ZeRO split into disjoint shards (over data-parallel ranks, experts
    over expert-data-parallel ranks)."""
    dense_kinds, expert_kinds = strategy.gradient_kinds()
    dense_sq = _model_parallel_sq_norm(dense_grads, dense_kinds, grid.tp_rank, grid.device)
    expert_sq = _model_parallel_sq_norm(expert_grads, expert_kinds, grid.expert_tp_rank, grid.device)
    local_nonfinite = ~torch.isfinite(dense_sq + expert_sq)
    strategy.sum_square_norms(dense_sq, expert_sq)
    all_reduce(dense_sq, grid.tp_group)
    all_reduce(expert_sq, grid.expert_tp_group)
    all_reduce(expert_sq, grid.ep_group)
    all_reduce(dense_sq, grid.pp_group)  # each stage holds its own layers
    all_reduce(expert_sq, grid.pp_group)
    return float(dense_sq + expert_sq), bool(local_nonfinite)
