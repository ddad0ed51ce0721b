"""What one aten op costs, from its arguments' and output's shapes.

Matrix products (mm, addmm, bmm, baddbmm, matmul, linear, oneDNN's linear, grouped and scaled
GEMMs) cost M x N x K multiply-accumulates (MACs), 2 FLOPs each; attention costs its two products,
Q K^T and P V, whichever kernel runs it. These are the GEMM FLOPs. Elementwise, activation,
normalisation and softmax ops, a GEMM's bias and attention's softmax cost one FLOP an output
element, reductions one an input element: the "other" FLOPs, kept apart so that GEMM FLOPs can be
compared alone. Everything else (views, copies, indexing, sorting, collectives) costs nothing.
Causal attention is counted whole, as FlopCounterMode counts it.

Ops are named without their overload and trailing underscore, so `add_.Tensor` costs as `add`.
"""

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass
class Cost:
    macs: int = 0  # multiply-accumulates of matrix products and attention
    other_flops: int = 0  # elementwise, normalisation, softmax, reductions

    @property
    def gemm_flops(self) -> int:
        return 2 * self.macs

    @property
    def flops(self) -> int:
        return self.gemm_flops + self.other_flops

    def add(self, other: "Cost") -> None:
        self.macs += other.macs
        self.other_flops += other.other_flops


Formula = Callable[[Sequence[object], object], Cost]


def _tensor(value: object) -> torch.Tensor:
    """The first tensor of an op's output (layer norm returns its mean and rstd too)."""
    if isinstance(value, (tuple, list)):
        return next(v for v in value if isinstance(v, torch.Tensor))
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"expected a tensor output, got {type(value).__name__}")
    return value


def _product(left: int, bias: int | None) -> Formula:
    """A product whose left operand is args[left] (its last dim the contracted K) and whose bias,
    if any, is args[bias]: every output element is K MACs."""

    def cost(args: Sequence[object], out: object) -> Cost:
        out_t, left_t = _tensor(out), _tensor(args[left])
        has_bias = bias is not None and len(args) > bias and args[bias] is not None
        return Cost(macs=out_t.numel() * left_t.shape[-1], other_flops=out_t.numel() if has_bias else 0)

    return cost


def _grouped_mm(args: Sequence[object], out: object) -> Cost:
    """torch._grouped_mm: each output row goes through one group, except for 2-D x 2-D, where the
    groups split K and the output [G, M, N] holds one product per group."""
    x, w, out_t = _tensor(args[0]), _tensor(args[1]), _tensor(out)
    per_group = out_t.numel() // out_t.shape[0] if x.dim() == 2 and w.dim() == 2 else out_t.numel()
    return Cost(macs=per_group * x.shape[-1])


def _attention(args: Sequence[object], out: object) -> Cost:
    """q [..., L, D], k [..., S, D], v [..., S, Dv]: L x S scores of D MACs, L x Dv outputs of S
    MACs, per batch and query head (key/value heads shared under GQA serve several query heads)."""
    q, k, v = _tensor(args[0]), _tensor(args[1]), _tensor(args[2])
    scores = math.prod(q.shape[:-1]) * k.shape[-2]
    return Cost(macs=scores * (q.shape[-1] + v.shape[-1]), other_flops=scores)


def _per_output(args: Sequence[object], out: object) -> Cost:
    return Cost(other_flops=_tensor(out).numel())


def _per_input(args: Sequence[object], out: object) -> Cost:
    return Cost(other_flops=_tensor(args[0]).numel())


def _per_source(args: Sequence[object], out: object) -> Cost:
    """index_add and scatter_add: one add per source element (self, dim, index, source)."""
    return Cost(other_flops=_tensor(args[3]).numel())


_ATTENTION = """scaled_dot_product_attention _scaled_dot_product_flash_attention
    _scaled_dot_product_flash_attention_for_cpu _scaled_dot_product_efficient_attention
    _scaled_dot_product_cudnn_attention _scaled_dot_product_fused_attention_overrideable
    _scaled_dot_product_attention_math"""
_ELEMENTWISE = """add sub rsub mul div neg reciprocal pow exp exp2 log log2 log1p sqrt rsqrt abs sin cos tanh
    sigmoid silu gelu relu leaky_relu elu hardtanh clamp clamp_min clamp_max maximum minimum addcmul addcdiv lerp
    softmax _softmax log_softmax _log_softmax layer_norm native_layer_norm rms_norm _fused_rms_norm group_norm
    native_group_norm native_batch_norm _native_batch_norm_legit dropout native_dropout"""
_REDUCTIONS = "sum mean logsumexp amax amin prod"

FORMULAS: dict[str, Formula] = {
    "aten::mm": _product(0, None),
    "aten::bmm": _product(0, None),
    "aten::matmul": _product(0, None),
    "aten::_scaled_mm": _product(0, None),
    "aten::linear": _product(0, 2),
    "mkldnn::_linear_pointwise": _product(0, 2),
    "aten::addmm": _product(1, 0),
    "aten::baddbmm": _product(1, 0),
    "aten::_addmm_activation": _product(1, 0),
    "aten::_grouped_mm": _grouped_mm,
    **{f"aten::{name}": _attention for name in _ATTENTION.split()},
    **{f"aten::{name}": _per_output for name in _ELEMENTWISE.split()},
    **{f"aten::{name}": _per_input for name in _REDUCTIONS.split()},
    "aten::index_add": _per_source,
    "aten::scatter_add": _per_source,
}


def op_cost(func: torch._ops.OpOverload, args: Sequence[object], out: object) -> Cost | None:
    """The op's cost, or None for an op that costs nothing (not in `FORMULAS`)."""
    formula = FORMULAS.get(func.name().split(".")[0].rstrip("_"))
    return None if formula is None else formula(args, out)
