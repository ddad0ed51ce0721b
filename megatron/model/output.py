"""The record a GPT forward returns, whatever the pipeline stage and whether labels were given.

Legend: B batch, S sequence, H hidden, V (padded) vocabulary.
"""

from dataclasses import dataclass

import torch

from megatron.model.moe.layer import RoutingStats


@dataclass
class GPTOutput:
    """The last stage (or the whole model) fills `logits_BSV` without labels or when asked for
    them, and `losses_BS` with labels; a pipeline stage before the last fills `hidden_BSH`."""

    router_loss: torch.Tensor  # this stage's MoE layers' weighted router losses, summed; 0 when dense
    routing: dict[int, RoutingStats]  # this stage's MoE layers' statistics by 1-based layer number
    logits_BSV: torch.Tensor | None = None  # the whole vocabulary's, gathered under tensor parallelism
    losses_BS: torch.Tensor | None = None  # fp32 per-token cross entropy
    hidden_BSH: torch.Tensor | None = None  # for the next pipeline stage
