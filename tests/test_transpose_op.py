"""The padded transpose of megatron/ops/transpose.py (native extension csrc/transpose) against
torch's transposing copy: exact equality, since it only moves values."""

import pytest
import torch

from megatron.ops.transpose import native_transpose_built, transposed_padded


def reference(a_pK: torch.Tensor, rows: int) -> torch.Tensor:
    a_Kp = a_pK.t().contiguous()
    a_Kp[:, rows:] = 0
    return a_Kp


def test_native_extension_is_built():
    assert native_transpose_built(), "megatron.ops._transpose is not built; run `pip install -e .`"


# whole 8 x 8 tiles, partial tiles at both edges, a block narrower than one tile, no rows kept
@pytest.mark.parametrize(
    "p, k, rows",
    [(512, 2048, 500), (64, 40, 64), (13, 7, 5), (8, 8, 8), (16, 24, 0), (33, 17, 33), (128, 512, 121), (1, 9, 1)],
)
def test_matches_torch(p, k, rows):
    a_pK = torch.randn(p, k, generator=torch.Generator().manual_seed(p * k + rows))
    got = transposed_padded(a_pK, rows)
    assert got.is_contiguous() and got.shape == (k, p)
    assert torch.equal(got, reference(a_pK, rows))


def test_reads_a_block_of_a_wider_matrix():
    whole = torch.randn(40, 30, generator=torch.Generator().manual_seed(0))
    block = whole[3:37, 2:26]  # row stride 30, not 24
    assert torch.equal(transposed_padded(block, 20), reference(block, 20))


def test_other_dtypes_take_torchs_copy():
    a_pK = torch.randn(24, 16).to(torch.bfloat16)
    assert torch.equal(transposed_padded(a_pK, 10), reference(a_pK, 10))


def test_rows_outside_the_block_are_refused():
    with pytest.raises(ValueError, match="keeps 0..4 rows"):
        transposed_padded(torch.zeros(4, 3), 5)
