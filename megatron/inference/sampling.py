"""Choosing the next token from the logits: greedy at temperature 0, otherwise sampling from the
temperature-scaled distribution cut to the top k tokens and to the top-p probability mass."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron.errors import ConfigError


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0  # 0: greedy (top_k and top_p are then unused)
    top_k: int = 0  # 0: no cut
    top_p: float = 1.0  # 1: no cut

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ConfigError(f"--temperature must be 0 (greedy) or positive, got {self.temperature}")
        if self.top_k < 0:
            raise ConfigError(f"--top-k must be 0 (off) or positive, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"--top-p must be in (0, 1], got {self.top_p}")


def sample_next(
    logits_BV: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None = None
) -> torch.Tensor:
    """One token id per row [B]."""
    if sampling.temperature == 0:
        return logits_BV.argmax(dim=-1)
    logits_BV = logits_BV.float() / sampling.temperature
    if sampling.top_k:
        kth_B1 = torch.topk(logits_BV, min(sampling.top_k, logits_BV.shape[-1]), dim=-1).values[:, -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth_B1, float("-inf"))
    if sampling.top_p < 1:
        sorted_BV, order_BV = logits_BV.sort(dim=-1, descending=True)
        probs_BV = F.softmax(sorted_BV, dim=-1)
        # drop a token when the tokens ranked above it already hold top_p: the best always stays
        beyond_BV = probs_BV.cumsum(dim=-1) - probs_BV >= sampling.top_p
        logits_BV = logits_BV.scatter(-1, order_BV, sorted_BV.masked_fill(beyond_BV, float("-inf")))
    probs_BV = F.softmax(logits_BV, dim=-1)
    return torch.multinomial(probs_BV, 1, generator=generator).squeeze(-1)
