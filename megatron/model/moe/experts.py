"""This rank's experts as stacked weights, run with grouped GEMMs.

Legend: E_l local experts, H hidden, F expert ffn hidden, N routed rows (sorted by expert),
P rows after padding on the CPU (see `padded_rows`).
"""

import torch
import torch.nn.functional as F
from torch import nn

from megatron.model.moe.grouped_gemm import grouped_linear


class GroupedExperts(nn.Module):
    """GELU MLP experts H -> F -> H with biases. Parameters carry `expert_global_ids` (dim 0 holds
    those experts), which the runtime uses to reduce, save and load them by global expert id."""

    def __init__(
        self, num_experts: int, global_ids: list[int], hidden_size: int, ffn_hidden_size: int,
        init_std: float, output_init_std: float,
    ) -> None:
        super().__init__()
        local = len(global_ids)
        self.w1 = nn.Parameter(torch.empty(local, hidden_size, ffn_hidden_size))
        self.b1 = nn.Parameter(torch.zeros(local, ffn_hidden_size))
        self.w2 = nn.Parameter(torch.empty(local, ffn_hidden_size, hidden_size))
        self.b2 = nn.Parameter(torch.zeros(local, hidden_size))
        for param in self.parameters():
            param.expert_global_ids = tuple(global_ids)
        self._init_by_global_id(num_experts, global_ids, init_std, output_init_std)

    @torch.no_grad()
    def _init_by_global_id(self, num_experts: int, global_ids: list[int], std: float, output_std: float) -> None:
        """Draw every expert of the layer in global order and keep this rank's: the same seed gives
        the same experts, and leaves the RNG in the same state, whatever the expert-parallel size."""
        local_index = {g: i for i, g in enumerate(global_ids)}
        for g in range(num_experts):
            w1 = torch.empty_like(self.w1[0]).normal_(0.0, std)
            w2 = torch.empty_like(self.w2[0]).normal_(0.0, output_std)
            if g in local_index:
                self.w1[local_index[g]] = w1
                self.w2[local_index[g]] = w2

    def forward(self, x_NH: torch.Tensor, counts_El: torch.Tensor) -> torch.Tensor:
        w1, b1, w2, b2 = self.w1, self.b1, self.w2, self.b2
        if torch.is_autocast_enabled(x_NH.device.type):  # grouped GEMMs are not on autocast's list
            dtype = torch.get_autocast_dtype(x_NH.device.type)
            x_NH, w1, b1, w2, b2 = (t.to(dtype) for t in (x_NH, w1, b1, w2, b2))
        rows = x_NH.shape[0]
        if x_NH.device.type == "cpu":
            x_NH, counts_El = pad_last_group(x_NH, counts_El, padded_rows(rows))
        return grouped_linear(F.gelu(grouped_linear(x_NH, w1, b1, counts_El)), w2, b2, counts_El)[:rows]


def padded_rows(rows: int) -> int:
    """`rows` rounded up to one of 8 sizes per power of two (at most 1/8 more rows).

    The number of routed rows changes from step to step. On the CPU, torch runs GELU (forward and
    backward) through oneDNN, which compiles and caches a kernel for every new input shape; each
    leaves many small long-lived allocations in the holes that freed activations leave in glibc's
    heap, so those holes can no longer hold the next step's large tensors nor go back to the
    system, and the process grows by megabytes per step for hundreds of steps
    (benchmarks/memory.py). With few sizes, the kernels are all compiled in the first steps."""
    step = 1 << max(rows.bit_length() - 4, 0)
    return -(-rows // step) * step


def pad_last_group(x_NH: torch.Tensor, counts_El: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero rows appended to the last expert's group up to `rows` [P, H]: their outputs are cut
    off after the experts, so they add nothing to any gradient."""
    pad = rows - x_NH.shape[0]
    if pad == 0:
        return x_NH, counts_El
    counts_El = counts_El.clone()
    counts_El[-1] += pad
    return F.pad(x_NH, (0, 0, 0, pad)), counts_El

