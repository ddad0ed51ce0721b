"""Grouped GEMM: rows of x [N, K], grouped by expert (counts [G]), times that group's w [G, K, M],
plus that group's bias b [G, M] if there is one. The experts' path off the CPU (experts.py runs its own loop there).

`torch._grouped_mm` where it runs for this device, dtype and shape (probed once each); otherwise a
loop over groups whose backward writes each group's weight gradient into one stacked tensor
(slicing a stacked parameter in a Python loop would give every slice a full-size gradient).
"""

import functools

import torch


class _LoopedGroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_NK: torch.Tensor, w_GKM: torch.Tensor, counts: list[int]) -> torch.Tensor:
        ctx.save_for_backward(x_NK, w_GKM)
        ctx.counts = counts
        y_NM = x_NK.new_empty(x_NK.shape[0], w_GKM.shape[2])
        for g, (x_part, y_part) in enumerate(zip(x_NK.split(counts), y_NM.split(counts))):
            torch.matmul(x_part, w_GKM[g], out=y_part)
        return y_NM

    @staticmethod
    def backward(ctx, grad_NM: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x_NK, w_GKM = ctx.saved_tensors
        grad_x = torch.empty_like(x_NK)
        grad_w = torch.zeros_like(w_GKM)
        parts = zip(x_NK.split(ctx.counts), grad_NM.split(ctx.counts), grad_x.split(ctx.counts))
        for g, (x_part, grad_part, grad_x_part) in enumerate(parts):
            torch.matmul(grad_part, w_GKM[g].t(), out=grad_x_part)
            torch.matmul(x_part.t(), grad_part, out=grad_w[g])
        return grad_x, grad_w, None


@functools.cache
def grouped_mm_runs(device_type: str, dtype: torch.dtype, k: int, m: int) -> bool:
    """Whether torch._grouped_mm runs forward and backward for this case (uneven, empty groups)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    device = torch.device(device_type)
    # the first call can come from inside a forward: under no_grad (evaluation) or an activation
    # checkpoint, whose saved-tensor hooks would count the probe's tensors; no random numbers
    # either, so the caller's RNG stream is the same whether or not the probe ran
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        try:
            x = torch.ones(24, k, device=device, dtype=dtype, requires_grad=True)
            w = torch.ones(3, k, m, device=device, dtype=dtype, requires_grad=True)
            offs = torch.tensor([8, 8, 24], device=device, dtype=torch.int32)
            torch._grouped_mm(x, w, offs=offs).backward(torch.ones(24, m, device=device, dtype=dtype))
            return True
        except (RuntimeError, NotImplementedError):
            return False


def grouped_linear(
    x_NK: torch.Tensor,
    w_GKM: torch.Tensor,
    b_GM: torch.Tensor | None,
    counts_G: torch.Tensor,
) -> torch.Tensor:
    """y[rows of group g] = x[rows of group g] @ w[g] + b[g] (no bias where b is None); rows must be sorted by group."""
    if grouped_mm_runs(x_NK.device.type, x_NK.dtype, w_GKM.shape[1], w_GKM.shape[2]):
        y_NM = torch._grouped_mm(x_NK, w_GKM, offs=torch.cumsum(counts_G, 0).to(torch.int32))
    else:
        y_NM = _LoopedGroupedLinear.apply(x_NK, w_GKM, counts_G.tolist())
    if b_GM is None:
        return y_NM
    return y_NM + b_GM.repeat_interleave(counts_G, dim=0, output_size=x_NK.shape[0])
