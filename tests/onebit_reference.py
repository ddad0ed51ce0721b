"""1-bit compressed averaging written out in plain torch for P simulated ranks (no packing, no
collectives): what megatron/comm/onebit.py must compute, for its tests and 1-bit Adam's."""

import torch


def one_bit(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x's signs times its RMS (zeros count as +1), and what that leaves out."""
    scale = torch.linalg.vector_norm(x) / x.numel() ** 0.5
    kept = scale * torch.where(x >= 0, 1.0, -1.0)
    return kept, x - kept


class ReferenceAveraging:
    """One buffer of `numel` (a multiple of 8 P) averaged over P ranks call after call, with every
    rank's worker error and every chunk's server error carried from call to call."""

    def __init__(self, numel: int, ranks: int) -> None:
        self.ranks, self.chunk = ranks, numel // ranks
        self.worker = [torch.zeros(numel) for _ in range(ranks)]
        self.server = [torch.zeros(self.chunk) for _ in range(ranks)]

    def __call__(self, buffers: list[torch.Tensor]) -> torch.Tensor:
        """What every rank gets: each rank's buffer plus its error compressed, each chunk averaged
        over the ranks plus its server error compressed again, the chunks concatenated."""
        sent = []
        for rank, buffer in enumerate(buffers):
            kept, self.worker[rank] = one_bit(buffer + self.worker[rank])
            sent.append(kept)
        out = []
        for c in range(self.ranks):
            span = slice(c * self.chunk, (c + 1) * self.chunk)
            kept, self.server[c] = one_bit(torch.stack([s[span] for s in sent]).sum(0) / self.ranks + self.server[c])
            out.append(kept)
        return torch.cat(out)
