"""Token dispatch by sort: routed (token, choice) pairs are gathered into rows grouped by expert,
sent to the experts' ranks with an uneven all-to-all, and the results come back the same way and
are summed into their tokens weighted by their gates. Memory grows with tokens x k x hidden only.

Under expert parallelism the rows per expert travel first, as an asynchronous all-to-all that
`exchange_counts` starts before the rows are gathered, so that it runs meanwhile; the receiving
rank needs them to size the row exchange. That is one small exchange per layer's forward; the
backward reuses the splits.

Legend: T tokens on this rank, K choices per token, H hidden, N kept pairs on this rank,
E experts in the layer, P expert-parallel ranks, E_l = E / P experts per rank,
R rows received from all ranks for this rank's experts.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron import comm
from megatron.model.moe.router import Gating
from megatron.timers import timed


class _AllToAll(torch.autograd.Function):
    """Uneven all_to_all_single whose backward sends the gradients back along the same routes."""

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup, timer: str
    ) -> torch.Tensor:
        ctx.splits, ctx.group, ctx.timer = (in_splits, out_splits), group, timer
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        with timed(timer):
            comm.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        out_splits, in_splits = ctx.splits
        back = grad.new_empty(sum(out_splits), *grad.shape[1:])
        with timed(ctx.timer):
            comm.all_to_all_single(back, grad.contiguous(), out_splits, in_splits, group=ctx.group)
        return back, None, None, None, None


def exchange_rows(
    x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup, timer: str
) -> torch.Tensor:
    """Rows `in_splits[r]` of x to rank r, `out_splits[r]` rows from it, concatenated in rank order;
    the backward sends the gradients back the same way. Both count under the timer named."""
    return _AllToAll.apply(x, out_splits, in_splits, group, timer)


@dataclass
class Routes:
    """Where each dispatched row came from, to undo the dispatch."""

    token_N: torch.Tensor  # token index of each row, rows sorted by global expert
    gate_N: torch.Tensor  # its gate (fp32)
    send_splits: list[int] | None = None  # rows sent to each expert-parallel rank
    recv_splits: list[int] | None = None  # rows received from each
    recv_blocks: list[list[int]] | None = None  # [P][E_l] rows received from each rank for each local expert


@dataclass
class ExpertCounts:
    """Kept rows per expert, on their way to the experts' ranks (`exchange_counts`)."""

    send_E: torch.Tensor  # rows this rank sends to each expert
    recv_PEl: torch.Tensor  # rows each rank sends to each of this rank's experts, once `work` is done
    work: dist.Work


def sort_by_expert(x_TH: torch.Tensor, gating: Gating, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, Routes]:
    """Rows [N, H] of kept (token, choice) pairs sorted by expert (token order within one), and
    the number of rows per expert [E]."""
    counts_E, routes = route_by_expert(gating, num_experts)
    return x_TH.index_select(0, routes.token_N), counts_E, routes


def route_by_expert(gating: Gating, num_experts: int) -> tuple[torch.Tensor, Routes]:
    """`sort_by_expert` without gathering the rows: rows per expert [E] and each row's token."""
    k = gating.expert_ids.shape[1]
    pair_N = torch.nonzero(gating.positions.flatten() >= 0).squeeze(1)
    expert_N = gating.expert_ids.flatten()[pair_N]
    order = torch.argsort(expert_N, stable=True)
    pair_N = pair_N[order]
    counts_E = torch.bincount(expert_N, minlength=num_experts)
    return counts_E, Routes(pair_N // k, gating.gates.flatten()[pair_N])


def exchange_counts(gating: Gating, num_experts: int, group: dist.ProcessGroup) -> ExpertCounts:
    """Start sending this rank's kept rows per expert to the experts' ranks. Counted from the
    gating, as `sort_by_expert` counts them, so that the exchange runs while the rows are gathered;
    by a scatter, which needs no host synchronisation on a GPU (a mask or bincount would)."""
    kept_N = (gating.positions.flatten() >= 0).long()
    send_E = kept_N.new_zeros(num_experts).scatter_add_(0, gating.expert_ids.flatten(), kept_N)
    recv_PEl = torch.empty_like(send_E)
    return ExpertCounts(send_E, recv_PEl, comm.all_to_all_single(recv_PEl, send_E, group=group, async_op=True))


def send_to_expert_ranks(
    x_NH: torch.Tensor, counts: ExpertCounts, routes: Routes, group: dist.ProcessGroup
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exchange rows with the expert-parallel group, sized by `counts` (from `exchange_counts`);
    returns rows [R, H] for this rank's experts, grouped by local expert, and the rows per local
    expert [E_l]."""
    ranks = dist.get_world_size(group)
    counts.work.wait()
    # one host copy of every count: on a GPU, the dispatch's one synchronisation
    host = torch.cat([counts.send_E, counts.recv_PEl]).tolist()
    half, local_experts = len(host) // 2, len(host) // (2 * ranks)
    send, recv = _rows_of(host[:half], local_experts), _rows_of(host[half:], local_experts)
    routes.send_splits, routes.recv_splits = [sum(row) for row in send], [sum(row) for row in recv]
    routes.recv_blocks = recv
    received_RH = exchange_rows(x_NH, routes.recv_splits, routes.send_splits, group, "moe-dispatch-all-to-all")
    return transpose_blocks(received_RH, recv), counts.recv_PEl.view(ranks, local_experts).sum(0)


def return_from_expert_ranks(y_RH: torch.Tensor, routes: Routes, group: dist.ProcessGroup) -> torch.Tensor:
    """Undo `send_to_expert_ranks`: rows [N, H] in this rank's sorted order again."""
    by_expert = [list(column) for column in zip(*routes.recv_blocks)]
    y_NH = transpose_blocks(y_RH, by_expert)
    return exchange_rows(y_NH, routes.send_splits, routes.recv_splits, group, "moe-combine-all-to-all")


def _rows_of(values: list[int], width: int) -> list[list[int]]:
    return [values[i : i + width] for i in range(0, len(values), width)]


def transpose_blocks(x_RH: torch.Tensor, sizes_AB: list[list[int]]) -> torch.Tensor:
    """Rows stored as a grid of blocks, block (a, b) after (a, b - 1), reordered so that (a, b)
    follows (a - 1, b): received rows by source rank, then expert, become rows by expert, then
    source rank. Block copies (their backward too), no per-row index."""
    blocks = x_RH.split([n for row in sizes_AB for n in row])
    columns = len(sizes_AB[0])
    return torch.cat([blocks[a * columns + b] for b in range(columns) for a in range(len(sizes_AB))])


def combine(y_NH: torch.Tensor, routes: Routes, num_tokens: int) -> torch.Tensor:
    """Sum each token's expert outputs weighted by their gates; dropped tokens get zeros."""
    return _Combine.apply(y_NH, routes.gate_N, routes.token_N, num_tokens)


class _Combine(torch.autograd.Function):
    """out[t] = sum of gate_n * y_n over the rows n of token t. Row blocks at a time, so that no
    [N, H] temporary is made besides the gathered output gradient, which the backward scales in
    place (autograd's own would hold three: the gather, its product with the gates and the one with
    the outputs, whose row sums are the gates' gradient)."""

    @staticmethod
    def forward(ctx, y_NH: torch.Tensor, gate_N: torch.Tensor, token_N: torch.Tensor, num_tokens: int) -> torch.Tensor:
        ctx.save_for_backward(y_NH, gate_N, token_N)
        out_TH = y_NH.new_zeros(num_tokens, y_NH.shape[1])
        for rows in row_blocks(len(y_NH)):
            out_TH.index_add_(0, token_N[rows], y_NH[rows] * gate_N[rows, None].to(y_NH.dtype))
        return out_TH

    @staticmethod
    def backward(ctx, grad_TH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, None, None]:
        y_NH, gate_N, token_N = ctx.saved_tensors
        grad_NH = grad_TH.index_select(0, token_N)
        grad_gate_N = gate_N.new_empty(gate_N.shape) if ctx.needs_input_grad[1] else None
        for rows in row_blocks(len(y_NH)):
            if grad_gate_N is not None:
                grad_gate_N[rows] = (grad_NH[rows] * y_NH[rows]).sum(1)
            grad_NH[rows] *= gate_N[rows, None].to(grad_NH.dtype)
        return grad_NH, grad_gate_N, None, None


def row_blocks(rows: int, block: int = 512) -> list[slice]:
    return [slice(start, start + block) for start in range(0, rows, block)]
