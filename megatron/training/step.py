"""One micro-batch's forward on this pipeline stage, written once for training and evaluation,
with one pipeline stage or several, with a teacher or without: the model's output turned into the
loss terms (`Losses`), the routing statistics and what the next stage needs.

Legend: B batch, S sequence, H hidden, V (padded) vocabulary.
"""

from dataclasses import dataclass
from typing import Protocol

import torch

from megatron.model import GPTModel
from megatron.model.moe.layer import RoutingStats
from megatron.runtime.engine import Engine
from megatron.training.losses import Losses, kd_divergence_BS, masked_mean


@dataclass(frozen=True)
class GPTBatch:
    """A micro-batch: the input tokens, the next tokens they predict, and which of them count."""

    tokens_BS: torch.Tensor
    labels_BS: torch.Tensor
    loss_mask_BS: torch.Tensor  # fp32, 0 where --eod-mask-loss leaves a token out


def gpt_batch(text: torch.Tensor, eod: int, eod_mask_loss: bool, device: torch.device) -> GPTBatch:
    """Split seq+1 tokens into inputs and shifted labels, with the loss mask (the datasets have
    checked every id against the vocabulary as they read the sample)."""
    text = text.to(device, non_blocking=True)
    tokens, labels = text[:, :-1], text[:, 1:]
    loss_mask = (tokens != eod).float() if eod_mask_loss else torch.ones_like(labels, dtype=torch.float32)
    return GPTBatch(tokens, labels, loss_mask)


@dataclass(frozen=True)
class StageForward:
    """What one micro-batch's forward left on this stage."""

    losses: Losses
    routing: dict[int, RoutingStats]  # this stage's MoE layers' statistics by 1-based layer number
    hidden_BSH: torch.Tensor | None  # for the next stage; None on the last one


def forward_step(
    engine: Engine,
    batch: GPTBatch,
    teacher: GPTModel | None = None,
    temperature: float = 1.0,
    hidden_BSH: torch.Tensor | None = None,
) -> StageForward:
    """The micro-batch through this stage (from the previous stage's `hidden_BSH` after the first).
    With a `teacher` (on the last stage, while distilling) the KD term too: the LM head runs once
    for both the student's loss and its logits."""
    if teacher is not None:
        with torch.no_grad(), engine.autocast():
            teacher_logits_BSV = teacher(batch.tokens_BS).logits_BSV
    output = engine(
        batch.tokens_BS, labels_BS=batch.labels_BS, return_logits=teacher is not None, hidden_BSH=hidden_BSH
    )
    if output.losses_BS is None:  # a stage before the last: only its router losses
        zero = torch.zeros_like(output.router_loss)
        return StageForward(Losses(lm=zero, moe=output.router_loss, kd=zero), output.routing, output.hidden_BSH)
    lm = masked_mean(output.losses_BS, batch.loss_mask_BS)
    if teacher is None:
        kd = torch.zeros_like(lm)
    else:
        kd = masked_mean(kd_divergence_BS(output.logits_BSV, teacher_logits_BSV, temperature), batch.loss_mask_BS)
    return StageForward(Losses(lm=lm, moe=output.router_loss, kd=kd), output.routing, None)


class ForwardStep(Protocol):
    """The trainer's seam for what a forward computes: `forward_step`, or a test's wrapper of it
    that injects a fault (a NaN loss at some iteration, say)."""

    def __call__(
        self,
        engine: Engine,
        batch: GPTBatch,
        teacher: GPTModel | None = None,
        temperature: float = 1.0,
        hidden_BSH: torch.Tensor | None = None,
    ) -> StageForward: ...
