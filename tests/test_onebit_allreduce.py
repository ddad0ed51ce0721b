"""The 1-bit compressed all-reduce (megatron/comm/onebit.py) against the algorithm written out in
plain torch for P simulated ranks (tests/onebit_reference.py), on 2 and 4 gloo ranks over
several calls, so that both error-feedback buffers carry over; the sign packing round trip; and
the bytes it sends, counted by the communication log."""

import pytest
import torch

from megatron.comm.comms_log import CommsLog
from megatron.comm.onebit import ErrorFeedback, compressed_allreduce, pack_signs, padded_numel, unpack_signs
from tests.dist_utils import run_distributed
from tests.onebit_reference import ReferenceAveraging

N, CALLS = 64 * 12, 4


def _buffer(rank: int, call: int) -> torch.Tensor:
    x = torch.randn(N, generator=torch.Generator().manual_seed(1000 * call + rank))
    x[::7] = 0.0  # zeros compress as +1
    return x


def reference(ranks: int) -> list[torch.Tensor]:
    """What every rank should get from each call."""
    averaging = ReferenceAveraging(N, ranks)
    return [averaging([_buffer(rank, call) for rank in range(ranks)]) for call in range(CALLS)]


def _rank_calls(ranks: int) -> dict[str, torch.Tensor]:
    rank = torch.distributed.get_rank()
    errors = ErrorFeedback.zeros(N, ranks, torch.device("cpu"))
    log = CommsLog()
    with log.recording():
        out = {f"call{c}": compressed_allreduce(_buffer(rank, c), errors, None) for c in range(CALLS)}
    sizes = {(row.op, row.message_bytes): row.count for row in log.summary()}
    out["bytes"] = torch.tensor([size * count for (_, size), count in sizes.items()]).sum()
    return out


@pytest.mark.parametrize("ranks", [2, 4])
def test_the_compressed_allreduce_is_the_algorithm_written_out(ranks):
    expected = reference(ranks)
    for got in run_distributed(_rank_calls, ranks, ranks):
        for call in range(CALLS):
            torch.testing.assert_close(got[f"call{call}"], expected[call], rtol=1e-6, atol=1e-6)
        # per call: all-to-all of N/8 sign bytes, all-gather of the chunks' N/8, and two of P scales
        assert int(got["bytes"]) == CALLS * (N // 8 + N // 8 + 2 * 4 * ranks)


def test_signs_pack_eight_to_a_byte_high_bit_first_and_unpack():
    x = torch.tensor([1.0, -2.0, 0.0, -0.5, 3.0, -1.0, -1.0, 2.0] * 3)
    packed = pack_signs(x)
    assert packed.dtype == torch.uint8 and packed.tolist() == [0b10101001] * 3
    assert unpack_signs(packed).tolist() == [1.0, -1.0, 1.0, -1.0, 1.0, -1.0, -1.0, 1.0] * 3
    assert padded_numel(100, 4) == 128 and padded_numel(64, 4) == 64


def test_a_buffer_that_does_not_split_into_packed_chunks_is_refused():
    assert all(bool(rank["refused"]) for rank in run_distributed(_refused, 2))


def _refused() -> dict[str, torch.Tensor]:
    with pytest.raises(ValueError, match="needs a multiple of 16 elements, not 20"):
        compressed_allreduce(torch.ones(20), ErrorFeedback.zeros(16, 2, torch.device("cpu")), None)
    return {"refused": torch.tensor(True)}
