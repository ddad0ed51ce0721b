"""A float32 row block transposed into a contiguous matrix with zero columns appended: the layout in
which the experts' weight gradients feed each expert's rows to oneDNN (megatron/model/moe/experts.py).
Through the native extension csrc/transpose (AVX2 tiles; torch's transposing copy is 1.8-3.6x
slower at these sizes, docs/benchmarks.md) where it is built and the block is a float32 CPU matrix
with unit column stride, else through torch, with the same result."""

import torch

try:
    from megatron.ops import _transpose
except ImportError:  # built by `pip install -e .`; without it torch's copy gives the same values
    _transpose = None


def native_transpose_built() -> bool:
    return _transpose is not None


def transposed_padded(a_pK: torch.Tensor, rows: int) -> torch.Tensor:
    """[K, p] = a^T with columns `rows` onwards zero (a's rows past `rows` are not read)."""
    p, k = a_pK.shape
    if not 0 <= rows <= p:
        raise ValueError(f"transposed_padded keeps 0..{p} rows of a [{p}, {k}] block, not {rows}")
    if (
        _transpose is None
        or a_pK.dtype != torch.float32
        or a_pK.device.type != "cpu"
        or a_pK.stride(1) != 1
        or a_pK.stride(0) < k
    ):
        a_Kp = a_pK.t().contiguous()
        a_Kp[:, rows:] = 0
        return a_Kp
    a_Kp = a_pK.new_empty(k, p)
    _transpose.transpose_padded(a_pK.data_ptr(), a_pK.stride(0), a_Kp.data_ptr(), p, rows, p, k)
    return a_Kp
