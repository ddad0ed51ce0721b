"""Load-balancing losses (`--moe-router-load-balancing-type`): the Switch-Transformer auxiliary loss
over the batch, or per sequence as DeepSeek-V2/V3 and Megatron-Core's seq_aux_loss, or none.

Legend: S tokens, E experts, K = top-k, B sequences, L tokens per sequence (S = B x L).
"""

import torch

from megatron.model.moe.config import MoEConfig


def load_balancing_loss(gates_SE: torch.Tensor, chosen_N: torch.Tensor, num_chosen_per_token: int) -> torch.Tensor:
    """E * sum_e(mean gate of e * fraction of choices that are e), divided by the choices per token."""
    num_tokens, num_experts = gates_SE.shape
    fraction_E = torch.bincount(chosen_N, minlength=num_experts).float() / max(num_tokens, 1)
    return num_experts * torch.sum(gates_SE.mean(0) * fraction_E) / num_chosen_per_token


def loss_scores(logits_SE: torch.Tensor, score_function: str) -> torch.Tensor:
    """Each token's probabilities over all experts, as the losses (and the router-entropy statistic)
    see them: the softmax, or the sigmoid scores divided by their sum (Megatron-Core)."""
    logits_SE = logits_SE.float()
    if score_function == "softmax":
        return torch.softmax(logits_SE, dim=-1)
    scores_SE = torch.sigmoid(logits_SE)
    return scores_SE / (scores_SE.sum(dim=-1, keepdim=True) + 1e-20)


def sequence_loss(scores_SE: torch.Tensor, k: int, num_sequences: int) -> torch.Tensor:
    """The auxiliary loss of each sequence on its own (its tokens' top-k choices and mean
    probabilities), averaged over the sequences: Megatron-Core's sequence_load_balancing_loss_func."""
    num_tokens, num_experts = scores_SE.shape
    scores_BLE = scores_SE.view(num_sequences, num_tokens // num_sequences, num_experts)
    chosen_BN = scores_BLE.topk(k, dim=-1).indices.flatten(1)
    counts_BE = torch.zeros(num_sequences, num_experts, device=scores_SE.device).scatter_add_(
        1, chosen_BN, torch.ones_like(chosen_BN, dtype=torch.float32))
    fraction_BE = counts_BE / scores_BLE.shape[1]
    return (num_experts / k * fraction_BE * scores_BLE.mean(dim=1)).sum(dim=1).mean()


def balancing_loss(logits_SE: torch.Tensor, config: MoEConfig, num_sequences: int) -> torch.Tensor:
    """The unweighted loss of `config.router_load_balancing_type`, counting each token's top-k of the
    unbiased scores over all experts as Megatron-Core does (DeepSpeed's aux_loss is topk_gating's own)."""
    if config.router_load_balancing_type == "none":
        return torch.zeros((), device=logits_SE.device)
    scores_SE = loss_scores(logits_SE, config.score_function)
    if config.router_load_balancing_type == "seq_aux_loss":
        return sequence_loss(scores_SE, config.topk, num_sequences)
    return load_balancing_loss(scores_SE, scores_SE.topk(config.topk, dim=-1).indices.flatten(), config.topk)
