"""The training objective's terms and their formulas: the masked token mean and the distillation
divergence. A new loss term is one field of `Losses` and the function that computes it.

Legend: B batch, S sequence, V (padded) vocabulary.
"""

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

from megatron.config.distill_flags import DistillConfig
from megatron.parallel import all_reduce


def masked_mean(values_BS: torch.Tensor, mask_BS: torch.Tensor) -> torch.Tensor:
    """Mean over the tokens the loss mask keeps (0 when it keeps none)."""
    return (values_BS * mask_BS).sum() / mask_BS.sum().clamp(min=1.0)


def kd_divergence_BS(
    student_logits_BSV: torch.Tensor, teacher_logits_BSV: torch.Tensor, temperature: float
) -> torch.Tensor:
    """Per token T^2 * KL(softmax(teacher / T) || softmax(student / T)), in fp32. The T^2 keeps the
    gradient's size independent of T (Hinton et al.), so --kd-beta-ce means the same at any T."""
    student_BSV = F.log_softmax(student_logits_BSV.float() / temperature, dim=-1)
    teacher_BSV = F.log_softmax(teacher_logits_BSV.float() / temperature, dim=-1)
    kl_BS = F.kl_div(student_BSV, teacher_BSV, reduction="none", log_target=True).sum(-1)
    return kl_BS * temperature**2


@dataclass(frozen=True)
class Losses:
    """One micro-batch's loss terms on this pipeline stage (fp32 scalars; a term a stage does not
    compute is 0 there), or a sum, mean or stack of them term by term."""

    lm: torch.Tensor  # masked-mean cross entropy (the last stage's)
    moe: torch.Tensor  # the MoE layers' weighted router losses (aux + z-loss), summed over this stage's layers
    kd: torch.Tensor  # masked-mean T^2 * KL to the teacher while distilling (the last stage's)

    @classmethod
    def zeros(cls, device: torch.device) -> "Losses":
        return cls.from_vector(torch.zeros(len(fields(cls)), device=device))

    @classmethod
    def from_vector(cls, vector: torch.Tensor) -> "Losses":
        """The terms from the last dimension of `vector`, in field order (a checkpoint's, a stack's)."""
        return cls(*vector.unbind(-1))

    def vector(self) -> torch.Tensor:
        """The terms in field order, as one tensor: one collective or one host copy for all of them."""
        return torch.stack([getattr(self, f.name) for f in fields(self)], dim=-1)

    def detach(self) -> "Losses":
        return Losses.from_vector(self.vector().detach())

    def __add__(self, other: "Losses") -> "Losses":
        return Losses.from_vector(self.vector() + other.vector())

    def __truediv__(self, count: int) -> "Losses":
        return Losses.from_vector(self.vector() / count)

    def summed_over(self, group: torch.distributed.ProcessGroup | None) -> "Losses":
        """Each term summed over `group`'s ranks (the pipeline stages: each computes its own terms)."""
        vector = self.vector()
        all_reduce(vector, group)
        return Losses.from_vector(vector)

    def objective(self, distill: DistillConfig | None) -> torch.Tensor:
        """What a micro-batch backpropagates: its LM and router losses, weighted with the KD term as
        --mos asks while distilling (`distill` None when it is not)."""
        if distill is None:
            return self.lm + self.moe
        return distill.alpha_ce * self.lm + self.moe + distill.beta_ce * self.kd
