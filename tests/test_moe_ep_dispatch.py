"""Expert-parallel dispatch: rows reach their expert's rank, come back to their place, and gradients
travel the same routes back; the counts exchanged ahead of the rows agree with the sort."""

import pytest
import torch
import torch.distributed as dist

from megatron.model.moe.dispatch import (
    exchange_counts,
    return_from_expert_ranks,
    send_to_expert_ranks,
    sort_by_expert,
    transpose_blocks,
)
from megatron.model.moe.router import Gating
from tests.dist_utils import run_distributed

H = 4


def test_transpose_blocks_reorders_blocks_and_its_gradient_goes_back():
    sizes_AB = [[2, 0, 1], [1, 3, 0]]  # block (a, b) holds rows labelled 10a + b
    labels = [10 * a + b for a, row in enumerate(sizes_AB) for b, n in enumerate(row) for _ in range(n)]
    x_RH = torch.tensor(labels, dtype=torch.float).repeat(H, 1).t().contiguous().requires_grad_()
    out_RH = transpose_blocks(x_RH, sizes_AB)
    assert out_RH[:, 0].tolist() == [0, 0, 10, 11, 11, 11, 2]
    grad_RH = torch.arange(out_RH.numel(), dtype=torch.float).view_as(out_RH)
    out_RH.backward(grad_RH)
    sizes_BA = [list(column) for column in zip(*sizes_AB)]
    torch.testing.assert_close(x_RH.grad, transpose_blocks(grad_RH, sizes_BA))
    torch.testing.assert_close(transpose_blocks(out_RH.detach(), sizes_BA), x_RH.detach())


def _gating(expert_ids_TK: torch.Tensor, kept_TK: torch.Tensor, num_experts: int) -> Gating:
    return Gating(
        torch.zeros(()),
        expert_ids_TK,
        torch.rand(expert_ids_TK.shape) * kept_TK,
        torch.where(kept_TK, 0, -1),
        torch.bincount(expert_ids_TK.flatten(), minlength=num_experts),
    )


def _round_trip(num_experts: int, all_to_first: bool) -> dict[str, torch.Tensor]:
    """Rows through experts that scale their rows by (global expert id + 1), and back."""
    group, rank, ranks = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    tokens, k = 6 + 3 * rank, 2
    expert_ids_TK = torch.randint(0, num_experts, (tokens, k))
    if all_to_first:  # the other ranks' experts receive nothing
        expert_ids_TK.zero_()
    gating = _gating(expert_ids_TK, torch.rand(tokens, k) < 0.8, num_experts)
    x_TH = torch.randn(tokens, H, requires_grad=True)
    counts = exchange_counts(gating, num_experts, group)
    rows_NH, counts_E, routes = sort_by_expert(x_TH, gating, num_experts)
    local_rows, local_counts = send_to_expert_ranks(rows_NH, counts, routes, group)
    local = num_experts // ranks
    scale_R = (torch.arange(local) + rank * local + 1.0).repeat_interleave(local_counts)
    y_NH = return_from_expert_ranks(local_rows * scale_R[:, None], routes, group)
    grad_NH = torch.randn(y_NH.shape)
    y_NH.backward(grad_NH)
    scale_N = (torch.arange(num_experts) + 1.0).repeat_interleave(counts_E)[:, None]
    all_counts_E = counts_E.clone()
    dist.all_reduce(all_counts_E)
    return {
        "sent_counts": counts.send_E,
        "sorted_counts": counts_E,
        "local_counts": local_counts,
        "expected_local_counts": all_counts_E[rank * local : (rank + 1) * local],
        "out": y_NH.detach(),
        "expected_out": rows_NH.detach() * scale_N,
        "x_grad": x_TH.grad,
        "expected_x_grad": torch.zeros_like(x_TH).index_add(0, routes.token_N, grad_NH * scale_N),
    }


@pytest.mark.parametrize("world, num_experts, all_to_first", [(2, 6, False), (2, 4, True), (4, 8, False)])
def test_rows_reach_their_experts_and_gradients_come_back(world, num_experts, all_to_first):
    for rank, result in enumerate(run_distributed(_round_trip, world, num_experts, all_to_first)):
        for name in ("sent_counts", "local_counts", "out", "x_grad"):
            want = result["sorted_counts" if name == "sent_counts" else f"expected_{name}"]
            torch.testing.assert_close(result[name], want, msg=f"rank {rank}: {name}")
