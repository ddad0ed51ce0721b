"""Expert tensor parallelism (Megatron-Core's --expert-tensor-parallel-size): every expert's F hidden
features are split over the expert-tensor-parallel group, w1 by columns and w2 by rows, as a
column-parallel linear followed by a row-parallel one. Each rank of the group then computes its
F / etp share of the output of every row the group holds: the rows (already at their experts'
ranks) are gathered from the whole group first, and the partial outputs are summed back on the
rank each row came from. The output bias goes in after that sum, once.

Both exchanges are uneven all-to-alls (a rank sends all its rows to every rank of the group; each
rank sends every rank the partial outputs of that rank's rows), so their backward is the matching
all-to-all the other way: gathering's adjoint sums the gradients of a row over the group, summing's
adjoint hands every rank the gradient of its share.

Legend: R rows on this rank grouped by local expert, E_l local experts, G ranks in the group,
Q rows of the whole group grouped by local expert (then by source rank), H hidden.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron import comm
from megatron.model.moe.dispatch import exchange_rows, transpose_blocks


@dataclass
class GroupRows:
    """How `gather_rows` laid out the group's rows, to send the results back."""

    blocks_GE: list[list[int]]  # rows each rank of the group holds for each local expert
    rank: int


def gather_rows(
    x_RH: torch.Tensor, counts_El: torch.Tensor, group: dist.ProcessGroup
) -> tuple[torch.Tensor, torch.Tensor, GroupRows]:
    """Every rank's rows for the local experts [Q, H], grouped by expert, the rows per expert [E_l],
    and their layout."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    counts_GE = [torch.empty_like(counts_El) for _ in range(size)]
    comm.all_gather(counts_GE, counts_El.contiguous(), group=group)
    stacked_GE = torch.stack(counts_GE)
    blocks_GE = stacked_GE.tolist()
    received_QH = exchange_rows(
        x_RH.repeat(size, 1), [sum(row) for row in blocks_GE], [len(x_RH)] * size, group, "moe-dispatch-all-to-all"
    )
    return transpose_blocks(received_QH, blocks_GE), stacked_GE.sum(0), GroupRows(blocks_GE, rank)


def sum_rows(partial_QH: torch.Tensor, layout: GroupRows, group: dist.ProcessGroup) -> torch.Tensor:
    """The group's sum of the partial outputs of this rank's rows [R, H], undoing `gather_rows`."""
    by_expert_EG = [list(column) for column in zip(*layout.blocks_GE)]
    by_rank_QH = transpose_blocks(partial_QH, by_expert_EG)
    rows, size = sum(layout.blocks_GE[layout.rank]), len(layout.blocks_GE)
    splits = [sum(row) for row in layout.blocks_GE]
    received_GRH = exchange_rows(by_rank_QH, [rows] * size, splits, group, "moe-combine-all-to-all")
    return received_GRH.view(size, rows, partial_QH.shape[1]).sum(0)
