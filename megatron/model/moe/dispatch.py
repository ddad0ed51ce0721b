"""Token dispatch by sort: routed (token, choice) pairs are gathered into rows grouped by expert,
sent to the experts' ranks with an uneven all-to-all, and the results come back the same way and
are summed into their tokens weighted by their gates. Memory grows with tokens x k x hidden only.

Legend: T tokens on this rank, K choices per token, H hidden, N kept pairs on this rank,
E experts in the layer, P expert-parallel ranks, E_l = E / P experts per rank,
R rows received from all ranks for this rank's experts.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron.model.moe.router import Gating


class _AllToAll(torch.autograd.Function):
    """Uneven all_to_all_single whose backward sends the gradients back along the same routes."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup) -> torch.Tensor:
        ctx.splits, ctx.group = (in_splits, out_splits), group
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        out_splits, in_splits = ctx.splits
        back = grad.new_empty(sum(out_splits), *grad.shape[1:])
        dist.all_to_all_single(back, grad.contiguous(), out_splits, in_splits, group=ctx.group)
        return back, None, None, None


@dataclass
class Routes:
    """Where each dispatched row came from, to undo the dispatch."""

    token_N: torch.Tensor  # token index of each row, rows sorted by global expert
    gate_N: torch.Tensor  # its gate (fp32)
    send_splits: list[int] | None = None  # rows sent to each expert-parallel rank
    recv_splits: list[int] | None = None  # rows received from each
    by_expert_R: torch.Tensor | None = None  # permutation of received rows into local-expert order


def sort_by_expert(x_TH: torch.Tensor, gating: Gating, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, Routes]:
    """Rows [N, H] of kept (token, choice) pairs sorted by expert (token order within one), and
    the number of rows per expert [E]."""
    k = gating.expert_ids.shape[1]
    pair_N = torch.nonzero(gating.positions.flatten() >= 0).squeeze(1)
    expert_N = gating.expert_ids.flatten()[pair_N]
    order = torch.argsort(expert_N, stable=True)
    pair_N = pair_N[order]
    token_N = pair_N // k
    counts_E = torch.bincount(expert_N, minlength=num_experts)
    return x_TH.index_select(0, token_N), counts_E, Routes(token_N, gating.gates.flatten()[pair_N])


def send_to_expert_ranks(
    x_NH: torch.Tensor, counts_E: torch.Tensor, routes: Routes, group: dist.ProcessGroup
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exchange rows with the expert-parallel group; returns rows [R, H] for this rank's experts,
    grouped by local expert, and the rows per local expert [E_l]."""
    ranks = dist.get_world_size(group)
    recv_counts_E = torch.empty_like(counts_E)
    dist.all_to_all_single(recv_counts_E, counts_E, group=group)  # [P * E_l]: source rank, then local expert
    recv_counts_PE = recv_counts_E.view(ranks, -1)
    routes.send_splits = counts_E.view(ranks, -1).sum(1).tolist()
    routes.recv_splits = recv_counts_PE.sum(1).tolist()
    received_RH = _AllToAll.apply(x_NH, routes.recv_splits, routes.send_splits, group)
    local_experts = recv_counts_PE.shape[1]
    block_R = torch.repeat_interleave(
        torch.arange(recv_counts_E.numel(), device=x_NH.device), recv_counts_E, output_size=received_RH.shape[0]
    )
    local_expert_R = block_R % local_experts
    routes.by_expert_R = torch.argsort(local_expert_R * ranks + block_R // local_experts, stable=True)
    return received_RH[routes.by_expert_R], recv_counts_PE.sum(0)


def return_from_expert_ranks(y_RH: torch.Tensor, routes: Routes, group: dist.ProcessGroup) -> torch.Tensor:
    """Undo `send_to_expert_ranks`: rows [N, H] in this rank's sorted order again."""
    unsorted_RH = torch.empty_like(y_RH).index_copy(0, routes.by_expert_R, y_RH)
    return _AllToAll.apply(unsorted_RH, routes.send_splits, routes.recv_splits, group)


def combine(y_NH: torch.Tensor, routes: Routes, num_tokens: int) -> torch.Tensor:
    """Sum each token's expert outputs weighted by their gates; dropped tokens get zeros."""
    weighted_NH = y_NH * routes.gate_N.unsqueeze(1).to(y_NH.dtype)
    return y_NH.new_zeros(num_tokens, y_NH.shape[1]).index_add(0, routes.token_N, weighted_NH)
