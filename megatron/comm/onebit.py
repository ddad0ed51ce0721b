"""The 1-bit compressed all-reduce of 1-bit Adam, 0/1 Adam and 1-bit LAMB (Tang et al. 2021,
DeepSpeed's `compressed_allreduce`), with error feedback on both sides.

Each rank adds its worker error to its buffer, keeps only the signs and one scale (the buffer's
RMS), and remembers what that dropped as the new worker error. The signs travel packed 8 to a
byte: an all-to-all gives each rank every rank's signs of its own chunk, which it averages
(scaled by each sender's scale), adds its server error to and compresses again the same way; an
all-gather then gives every rank every chunk's signs and scale. So each rank sends about 2 x N/8
bytes instead of the 2 x 4N of an fp32 ring all-reduce, and what compression dropped returns in
the next call rather than being lost. Signs of zero count as +1, as DeepSpeed's do.

Legend: N the buffer's elements (a multiple of 8 P), P the group's ranks, C = N / P a chunk.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron.comm import collectives

_BIT_WEIGHTS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)  # the first sign is the high bit


def padded_numel(numel: int, ranks: int) -> int:
    """The buffer size the compression works on: `numel` rounded up to a multiple of 8 x ranks."""
    unit = 8 * ranks
    return -(-numel // unit) * unit


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """x >= 0 as bits, 8 to a byte [numel / 8] (uint8)."""
    bits = (x >= 0).view(-1, 8).to(torch.uint8)
    return (bits * _BIT_WEIGHTS.to(x.device)).sum(1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """+1 / -1 for each bit of `packed` [bytes x 8]."""
    bits = packed.unsqueeze(-1).bitwise_and(_BIT_WEIGHTS.to(packed.device)).ne(0)
    return bits.flatten(-2).to(dtype).mul_(2).sub_(1)


def _compress(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The signs, the scale (x's RMS) and what they leave out of x (the new error)."""
    scale = torch.linalg.vector_norm(x) / x.numel() ** 0.5
    signs = torch.where(x >= 0, 1.0, -1.0).to(x.dtype)
    return signs, scale, x - scale * signs


@dataclass
class ErrorFeedback:
    """One buffer's two error terms, carried from call to call (and in checkpoints)."""

    worker: torch.Tensor  # [N]
    server: torch.Tensor  # [C]: this rank's chunk

    @classmethod
    def zeros(cls, numel: int, ranks: int, device: torch.device) -> "ErrorFeedback":
        return cls(torch.zeros(numel, device=device), torch.zeros(numel // ranks, device=device))


def compressed_allreduce(
    buffer_N: torch.Tensor, errors: ErrorFeedback, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """The group's mean of `buffer_N` (fp32, N a multiple of 8 P) through 1-bit compression;
    updates `errors` in place."""
    ranks = dist.get_world_size(group)
    numel = buffer_N.numel()
    if numel % (8 * ranks):
        raise ValueError(f"a compressed all-reduce needs a multiple of {8 * ranks} elements, not {numel}")
    signs_N, scale, worker_error = _compress(buffer_N + errors.worker)
    errors.worker.copy_(worker_error)
    received_PC = _exchange(collectives.all_to_all_single, signs_N, scale, numel // 8, ranks, group)
    server_signs_C, server_scale, server_error = _compress(received_PC.sum(0) / ranks + errors.server)
    errors.server.copy_(server_error)
    return _exchange(
        collectives.all_gather_into_tensor, server_signs_C, server_scale, numel // 8, ranks, group
    ).flatten()


def _exchange(
    send: Callable[..., object],
    signs: torch.Tensor,
    scale: torch.Tensor,
    buffer_bytes: int,
    ranks: int,
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """Send `signs` packed by `send` (all-to-all: rank r gets chunk r; all-gather: every rank gets
    all) with `scale` to every rank; returns what came, one row per sending rank, each row's signs
    times its sender's scale: [P, len(signs) / P] (all-to-all) or [P, len(signs)] (all-gather)."""
    packed = pack_signs(signs)
    # N / 8 bytes either way: every rank's chunk r (all-to-all), or every rank's chunk (all-gather)
    received = torch.empty(buffer_bytes, dtype=torch.uint8, device=signs.device)
    send(received, packed, group=group)
    scales_P = torch.empty(ranks, dtype=signs.dtype, device=signs.device)
    collectives.all_gather_into_tensor(scales_P, scale.reshape(1), group=group)
    return unpack_signs(received.view(ranks, -1), signs.dtype) * scales_P.unsqueeze(1)
