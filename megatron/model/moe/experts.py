"""This rank's experts as stacked weights (slices of them under expert tensor parallelism): on the
CPU one expert at a time through a fused MLP (`_LoopedExpertMLP`), elsewhere with grouped GEMMs.

Legend: E_l local experts, H hidden, F expert ffn hidden, W the first GEMM's width (F, or 2F for
SwiGLU), N routed rows (sorted by expert), X rows of the input (N, or T tokens that the rows
gather from), n one expert's rows, p those rows padded (see `padded_rows`).
"""

import functools
import itertools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron.errors import ConfigError
from megatron.model.moe.expert_tensor_parallel import gather_rows, sum_rows
from megatron.model.moe.grouped_gemm import grouped_linear
from megatron.model.tensor_parallel import mark_split, sum_gradient_over, tp_rank_and_size
from megatron.ops.transpose import transposed_padded
from megatron.placement import place
from megatron.tensor_split import shard


class GroupedExperts(nn.Module):
    """MLP experts H -> F -> H: GELU, or with `swiglu` H -> 2F -> (SwiGLU) F -> H (w1's first F
    columns feed silu, the second F the up projection, as the dense MLP's `dense_h_to_4h` rows);
    biases b1 and b2 unless `bias` is False (--disable-bias-linear). Each parameter's placement
    (megatron/placement.py) holds the global ids of its experts (dim 0 holds those experts), by
    which the runtime reduces, saves and loads them. With `tp_group` (expert tensor parallelism) this rank holds
    F / etp of every expert's hidden features (of each SwiGLU half) and computes with the rows of
    the whole group (expert_tensor_parallel.py)."""

    def __init__(
        self,
        num_experts: int,
        global_ids: list[int],
        hidden_size: int,
        ffn_hidden_size: int,
        init_std: float,
        output_init_std: float,
        swiglu: bool = False,
        bias: bool = True,
        tp_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        local = len(global_ids)
        self.swiglu = swiglu
        _, tp_size = tp_rank_and_size(tp_group)
        self.tp_group = tp_group if tp_size > 1 else None
        if ffn_hidden_size % tp_size:
            raise ConfigError(
                f"the experts' hidden size {ffn_hidden_size} (--moe-ffn-hidden-size, or --ffn-hidden-size) "
                f"is not divisible by --expert-tensor-parallel-size {tp_size}; choose sizes that divide it"
            )
        # SwiGLU's gate and up halves are each split, so that every rank holds matching features of both
        parts = (ffn_hidden_size, ffn_hidden_size) if swiglu else None
        width = 2 * ffn_hidden_size if swiglu else ffn_hidden_size
        self.w1 = nn.Parameter(torch.empty(local, hidden_size, width // tp_size))
        self.b1 = nn.Parameter(torch.zeros(local, width // tp_size)) if bias else None
        self.w2 = nn.Parameter(torch.empty(local, ffn_hidden_size // tp_size, hidden_size))
        self.b2 = nn.Parameter(torch.zeros(local, hidden_size)) if bias else None
        for param in self.parameters():
            place(param, expert_ids=tuple(global_ids))
        for param, dim, param_parts in ((self.w1, 2, parts), (self.b1, 1, parts), (self.w2, 1, None)):
            if param is not None:
                mark_split(param, dim, self.tp_group, param_parts)
        if self.b2 is not None:  # added once after the group's sum, to this rank's own rows
            sum_gradient_over(self.b2, self.tp_group)
        self._init_by_global_id(num_experts, global_ids, init_std, output_init_std, parts)
        self.grad_buffers = GradientBuffers()

    @torch.no_grad()
    def _init_by_global_id(
        self, num_experts: int, global_ids: list[int], std: float, output_std: float, parts: tuple[int, int] | None
    ) -> None:
        """Draw every expert of the layer whole in global order and keep this rank's (slices): the
        same seed gives the same experts, and leaves the RNG in the same state, whatever the
        expert-parallel and expert-tensor-parallel sizes."""
        tp_rank, tp_size = tp_rank_and_size(self.tp_group)
        local_index = {g: i for i, g in enumerate(global_ids)}
        hidden_size, width, ffn_hidden_size = self.w1.shape[1], self.w1.shape[2] * tp_size, self.w2.shape[1] * tp_size
        for g in range(num_experts):
            w1 = self.w1.new_empty(hidden_size, width).normal_(0.0, std)
            w2 = self.w2.new_empty(ffn_hidden_size, hidden_size).normal_(0.0, output_std)
            if g in local_index:
                self.w1[local_index[g]] = shard(w1, 1, tp_rank, tp_size, parts)
                self.w2[local_index[g]] = shard(w2, 0, tp_rank, tp_size)

    def forward(self, x_XH: torch.Tensor, counts_El: torch.Tensor, token_N: torch.Tensor | None = None) -> torch.Tensor:
        """Outputs [N, H] of the rows grouped by expert: x's rows, or with `token_N` x's rows token_N
        (gathered here, an expert at a time, instead of into an [N, H] copy)."""
        if self.tp_group is None:
            return self._mlp(x_XH, counts_El, token_N, self.b2)
        x_NH = x_XH if token_N is None else x_XH.index_select(0, token_N)
        rows_QH, counts_group_El, layout = gather_rows(x_NH, counts_El, self.tp_group)
        y_NH = sum_rows(self._mlp(rows_QH, counts_group_El, None, None), layout, self.tp_group)
        if self.b2 is None:
            return y_NH
        return y_NH + self.b2.to(y_NH.dtype).repeat_interleave(counts_El, dim=0, output_size=len(y_NH))

    def _mlp(
        self, x_XH: torch.Tensor, counts_El: torch.Tensor, token_N: torch.Tensor | None, b2: torch.Tensor | None
    ) -> torch.Tensor:
        w1, b1, w2 = self.w1, self.b1, self.w2
        if torch.is_autocast_enabled(x_XH.device.type):  # grouped GEMMs are not on autocast's list
            dtype = torch.get_autocast_dtype(x_XH.device.type)
            x_XH, w1, b1, w2, b2 = (None if t is None else t.to(dtype) for t in (x_XH, w1, b1, w2, b2))
        if x_XH.device.type == "cpu":
            return _LoopedExpertMLP.apply(
                x_XH,
                token_N,
                w1,
                b1,
                w2,
                b2,
                counts_El.tolist(),
                self.grad_buffers,
                self.swiglu,
            )
        x_NH = x_XH if token_N is None else x_XH.index_select(0, token_N)
        hidden_NF = activation(grouped_linear(x_NH, w1, b1, counts_El), self.swiglu)
        return grouped_linear(hidden_NF, w2, b2, counts_El)


def activation(h_pW: torch.Tensor, swiglu: bool) -> torch.Tensor:
    """The experts' activation of the first GEMM's output: GELU [p, F], or SwiGLU of [p, 2F] -> [p, F]."""
    if not swiglu:
        return F.gelu(h_pW)
    gate_pF, up_pF = h_pW.chunk(2, dim=-1)
    return F.silu(gate_pF) * up_pF


def activation_backward(grad_pF: torch.Tensor, h_pW: torch.Tensor, swiglu: bool) -> torch.Tensor:
    """The gradient of the activation's input from its output's; GELU's overwrites grad_pF."""
    if not swiglu:
        return torch.ops.aten.gelu_backward.grad_input(grad_pF, h_pW, grad_input=grad_pF)
    gate_pF, up_pF = h_pW.chunk(2, dim=-1)
    grad_pW = torch.empty_like(h_pW)
    grad_gate_pF, grad_up_pF = grad_pW.chunk(2, dim=-1)
    torch.mul(grad_pF, F.silu(gate_pF), out=grad_up_pF)
    torch.ops.aten.silu_backward.grad_input(grad_pF.mul_(up_pF), gate_pF, grad_input=grad_gate_pF)
    return grad_pW


def padded_rows(rows: int) -> int:
    """`rows` rounded up to one of 16 sizes per power of two (at most 1/16 more rows).

    Each expert's row count changes from step to step. On the CPU, oneDNN runs GELU (forward and
    backward) and the experts' GEMMs (`linear`), and compiles and caches a kernel for every new
    input shape (about 0.6 MiB each at h 512); each leaves many small long-lived allocations in the
    holes that freed activations leave in glibc's heap, so those holes can no longer hold the next
    step's large tensors nor go back to the system, and the process grows by megabytes per step for
    hundreds of steps (benchmarks/memory.py). With few sizes, the kernels are all compiled in the
    first steps. The padded rows are computed and thrown away: 16 sizes waste 1.5% of the GEMMs on
    average, 8 sizes measured 3%."""
    step = 1 << max(rows.bit_length() - 5, 0)
    return -(-rows // step) * step


class _LoopedExpertMLP(torch.autograd.Function):
    """y = act(x @ w1[e] + b1[e]) @ w2[e] + b2[e] for the rows of each expert e, one expert at a time
    (act: GELU or SwiGLU; b1 and b2 may be None).

    On the CPU this beats `torch._grouped_mm` (whose fallback loops over the groups too, with extra
    copies) and an activation over all rows: each expert's activation is still in cache when the
    next GEMM reads it, the biases ride in the GEMMs, and only the input and the pre-activations are
    saved (the backward recomputes each expert's activation, and frees each expert's pre-activations
    once it is done with them, as autograd frees DeepSpeed's per-expert graphs, so that the next
    expert's temporaries reuse their memory). The activation and the GEMMs whose rows are the
    expert's rows run over `padded_rows(n)` rows (the rows after an expert's own belong to the next
    expert, or are zeros, and their results are dropped) so that oneDNN sees few shapes. The weight
    gradients run over the padded blocks too, the rows past the expert's own zeroed."""

    @staticmethod
    def forward(
        ctx,
        x_XH: torch.Tensor,
        token_N: torch.Tensor | None,
        w1_EHW: torch.Tensor,
        b1_EW: torch.Tensor | None,
        w2_EFH: torch.Tensor,
        b2_EH: torch.Tensor | None,
        counts: list[int],
        grad_buffers: "GradientBuffers",
        swiglu: bool,
    ) -> torch.Tensor:
        spans = expert_spans(counts)
        y_NH = x_XH.new_empty(sum(counts), w2_EFH.shape[2])
        h_pW: list[torch.Tensor] = []
        with torch.autocast(x_XH.device.type, enabled=False):
            for e, (s, n, p) in enumerate(spans):
                if n == 0:
                    h_pW.append(x_XH.new_empty(0))
                    continue
                h_pW.append(linear(expert_rows(x_XH, token_N, s, p), w1_EHW[e].t(), expert_bias(b1_EW, e)))
                y_NH[s : s + n] = linear(activation(h_pW[-1], swiglu), w2_EFH[e].t(), expert_bias(b2_EH, e))[:n]
        ctx.save_for_backward(x_XH, token_N, w1_EHW, w2_EFH)
        # intermediates, held by ctx itself so that the backward can free each expert's as it goes
        ctx.h_pW, ctx.spans, ctx.grad_buffers, ctx.swiglu = h_pW, spans, grad_buffers, swiglu
        return y_NH

    @staticmethod
    def backward(ctx, grad_NH: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x_XH, token_N, w1_EHW, w2_EFH = ctx.saved_tensors
        h_pW, ctx.h_pW = ctx.h_pW, None
        if h_pW is None:
            raise RuntimeError(
                "the experts' backward ran twice through one forward; it frees the experts' "
                "activations as it goes, so run the forward again instead of retain_graph=True"
            )
        grad_NH = grad_NH.contiguous()
        grad_x = None
        if ctx.needs_input_grad[0]:  # gathered rows add their gradients into their tokens
            grad_x = torch.empty_like(x_XH) if token_N is None else torch.zeros_like(x_XH)
        # [w1, b1, w2, b2]; frozen experts take no gradient buffers, absent biases none either
        need_w1, need_b1, need_w2, need_b2 = ctx.needs_input_grad[2:6]
        grad_w1 = ctx.grad_buffers.take("w1", w1_EHW) if need_w1 else None
        grad_b1 = w1_EHW.new_empty(w1_EHW.shape[0], w1_EHW.shape[2]) if need_b1 else None
        grad_w2 = ctx.grad_buffers.take("w2", w2_EFH) if need_w2 else None
        grad_b2 = w2_EFH.new_empty(w2_EFH.shape[0], w2_EFH.shape[2]) if need_b2 else None
        weight_grads = [g for g in (grad_w1, grad_b1, grad_w2, grad_b2) if g is not None]
        with torch.autocast(x_XH.device.type, enabled=False):
            for e, (s, n, p) in enumerate(ctx.spans):
                h, h_pW[e] = h_pW[e], None  # freed once this expert is done, for the next one's temporaries
                if n == 0:  # an expert without rows gets zero gradients
                    for grad in weight_grads:
                        grad[e].zero_()
                    continue
                grad_pH = row_block(grad_NH, s, p)
                if grad_w2 is not None:
                    weight_gradient(activation(h, ctx.swiglu), grad_pH, n, grad_w2[e])
                if grad_b2 is not None:
                    torch.sum(grad_pH[:n], 0, out=grad_b2[e])
                grad_pW = activation_backward(linear(grad_pH, w2_EFH[e], None), h, ctx.swiglu)
                if grad_w1 is not None:
                    weight_gradient(expert_rows(x_XH, token_N, s, p), grad_pW, n, grad_w1[e])
                if grad_b1 is not None:
                    torch.sum(grad_pW[:n], 0, out=grad_b1[e])
                if grad_x is None:
                    continue
                grad_nH = linear(grad_pW, w1_EHW[e], None)[:n]
                if token_N is None:
                    grad_x[s : s + n] = grad_nH
                else:
                    grad_x.index_add_(0, token_N[s : s + n], grad_nH)
        return grad_x, None, grad_w1, grad_b1, grad_w2, grad_b2, None, None, None


def expert_bias(bias_EM: torch.Tensor | None, e: int) -> torch.Tensor | None:
    return None if bias_EM is None else bias_EM[e]


class GradientBuffers:
    """The experts' weight gradients, reused from step to step.

    Each is one tensor over all local experts, above glibc's largest heap allocation (32 MiB), so a
    fresh one is a fresh mapping whose pages the kernel faults in and zeroes one by one: on the
    development VM 10-22% of the layer's step (128 MiB a step at h 512, E 16; 512 MiB at E 64), which
    DeepSpeed's per-expert gradients, small enough for the heap, partly escape. The price: between
    steps the buffers stay allocated even where the gradients were set to None. A buffer is handed
    out again only when nothing else holds its storage, i.e. the gradient it became was set to None
    or was added into an existing .grad; otherwise a new one takes its place in the cache."""

    def __init__(self) -> None:
        self._cache: dict[str, tuple[torch.Tensor, int]] = {}  # name -> (buffer, its storage uses when idle)

    def take(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """An uninitialised tensor shaped as `like`, on a buffer nothing else uses."""
        buffer, idle_uses = self._cache.get(name, (None, 0))
        reusable = (
            buffer is not None
            and buffer.shape == like.shape
            and buffer.dtype == like.dtype
            and buffer.device == like.device
            and idle_uses >= 0
            and storage_uses(buffer) == idle_uses
        )
        if not reusable:
            buffer = torch.empty_like(like, memory_format=torch.contiguous_format)
            self._cache[name] = (buffer, storage_uses(buffer))
        return buffer.detach()  # a tensor of its own, which autograd may keep as .grad without copying


def storage_uses(t: torch.Tensor) -> int:
    """How many tensors (and storage objects) hold t's storage, through torch's private counter;
    -1 where this torch has none, which makes `GradientBuffers` allocate every time."""
    if not hasattr(torch._C, "_storage_Use_Count"):
        return -1
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def expert_rows(x_XH: torch.Tensor, token_N: torch.Tensor | None, start: int, rows: int) -> torch.Tensor:
    """Routed rows start .. start + rows [rows, H]: x's own, or gathered from x by token_N."""
    if token_N is None:
        return row_block(x_XH, start, rows)
    return x_XH.index_select(0, row_block(token_N, start, rows))


def row_block(t: torch.Tensor, start: int, rows: int) -> torch.Tensor:
    """t[start:start + rows], padded with zeros past t's end."""
    block = t[start : start + rows]
    return block if len(block) == rows else F.pad(block, (0, 0) * (t.dim() - 1) + (0, rows - len(block)))


def linear(x_pK: torch.Tensor, weight_MK: torch.Tensor, bias_M: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T + bias [p, M], through oneDNN where it runs (on the development VM's AMD EPYC
    10-15% faster in fp32 than the MKL sgemm behind torch.mm at these shapes), else torch's GEMM."""
    if onednn_linear_runs(x_pK.device.type, x_pK.dtype):
        return torch.ops.mkldnn._linear_pointwise(x_pK, weight_MK, bias_M, "none", [], "")
    if bias_M is None:
        return torch.mm(x_pK, weight_MK.t())
    return torch.addmm(bias_M, x_pK, weight_MK.t())


def weight_gradient(a_pK: torch.Tensor, b_pM: torch.Tensor, rows: int, out_KM: torch.Tensor) -> None:
    """out = a[:rows]^T b[:rows] (an expert's weight gradient from its padded row block). Through
    oneDNN's linear where it runs, on a contiguous copy of a^T whose columns past `rows` are zeroed
    (megatron/ops/transpose.py), so that oneDNN sees the padded row counts only (see `padded_rows`):
    faster than MKL's sgemm on the transposed view (docs/benchmarks.md, the MoE layer)."""
    if onednn_linear_runs(a_pK.device.type, a_pK.dtype):
        a_Kp = transposed_padded(a_pK, rows)
        out_KM.copy_(torch.ops.mkldnn._linear_pointwise(a_Kp, b_pM.t(), None, "none", [], ""))
    else:
        torch.mm(a_pK[:rows].t(), b_pM[:rows], out=out_KM)


@functools.cache
def onednn_linear_runs(device_type: str, dtype: torch.dtype) -> bool:
    """Whether oneDNN's linear (the op torch.compile uses on the CPU) runs here for this dtype."""
    if device_type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    try:
        x = torch.ones(2, 3, dtype=dtype)
        out = torch.ops.mkldnn._linear_pointwise(x, torch.ones(3, 4, dtype=dtype).t(), None, "none", [], "")
        return bool(torch.equal(out, torch.full((2, 4), 3.0, dtype=dtype)))
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


def expert_spans(counts: list[int]) -> list[tuple[int, int, int]]:
    """Each expert's (first row, rows, padded rows)."""
    return [(s, n, padded_rows(n)) for s, n in zip(itertools.accumulate(counts, initial=0), counts)]
