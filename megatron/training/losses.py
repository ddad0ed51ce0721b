"""Loss formulas of the training loop: the masked token mean and the distillation divergence.

Legend: B batch, S sequence, V (padded) vocabulary.
"""

import torch
import torch.nn.functional as F


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
