"""Load-balancing losses (`--moe-router-load-balancing-type`): the Switch-Transformer auxiliary loss
over the batch, or per sequence as DeepSeek-V2/V3 and Megatron-Core's seq_aux_loss, or none.

Under sequence parallelism a rank holds an equal share of each sequence's positions; the means and
fractions are then taken over the whole sequences (`sequence_group`), so that every rank computes
the loss of tensor-parallel size 1 and backward reaches each rank's own tokens.

Legend: S tokens, E experts, K = top-k, B sequences, L tokens per sequence (S = B x L).
"""

import torch
import torch.distributed as dist

from megatron.model.moe.config import MoEConfig
from megatron.model.tensor_parallel import reduce_from_tp_region
from megatron.parallel import all_reduce, is_parallel


def token_mean(values: torch.Tensor, dim: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The mean over the tokens along `dim` of every rank of `group` (equal shares); its gradient
    reaches this rank's tokens."""
    if not is_parallel(group):
        return values.mean(dim)
    return reduce_from_tp_region(values.sum(dim), group) / (values.shape[dim] * dist.get_world_size(group))


def choice_counts(chosen_N: torch.Tensor, num_experts: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Choices per expert over the ranks of `group`, as float."""
    counts_E = torch.bincount(chosen_N, minlength=num_experts).float()
    all_reduce(counts_E, group)
    return counts_E


def load_balancing_loss(
    gates_SE: torch.Tensor, chosen_N: torch.Tensor, num_chosen_per_token: int, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """E * sum_e(mean gate of e * fraction of choices that are e), divided by the choices per token."""
    num_tokens, num_experts = gates_SE.shape
    total_tokens = num_tokens * (dist.get_world_size(group) if is_parallel(group) else 1)
    fraction_E = choice_counts(chosen_N, num_experts, group) / max(total_tokens, 1)
    return num_experts * torch.sum(token_mean(gates_SE, 0, group) * fraction_E) / num_chosen_per_token


def loss_scores(logits_SE: torch.Tensor, score_function: str) -> torch.Tensor:
    """Each token's probabilities over all experts, as the losses (and the router-entropy statistic)
    see them: the softmax, or the sigmoid scores divided by their sum (Megatron-Core)."""
    logits_SE = logits_SE.float()
    if score_function == "softmax":
        return torch.softmax(logits_SE, dim=-1)
    scores_SE = torch.sigmoid(logits_SE)
    return scores_SE / (scores_SE.sum(dim=-1, keepdim=True) + 1e-20)


def sequence_loss(
    scores_SE: torch.Tensor, k: int, num_sequences: int, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """The auxiliary loss of each sequence on its own (its tokens' top-k choices and mean
    probabilities), averaged over the sequences: Megatron-Core's sequence_load_balancing_loss_func."""
    num_tokens, num_experts = scores_SE.shape
    scores_BLE = scores_SE.view(num_sequences, num_tokens // num_sequences, num_experts)
    chosen_BN = scores_BLE.topk(k, dim=-1).indices.flatten(1)
    counts_BE = torch.zeros(num_sequences, num_experts, device=scores_SE.device).scatter_add_(
        1, chosen_BN, torch.ones_like(chosen_BN, dtype=torch.float32)
    )
    all_reduce(counts_BE, group)
    mean_BE = token_mean(scores_BLE, 1, group)  # over each sequence's positions on every rank
    fraction_BE = counts_BE / (scores_BLE.shape[1] * (dist.get_world_size(group) if is_parallel(group) else 1))
    return (num_experts / k * fraction_BE * mean_BE).sum(dim=1).mean()


def balancing_loss(
    logits_SE: torch.Tensor, config: MoEConfig, num_sequences: int, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """The unweighted loss of `config.router_load_balancing_type`, counting each token's top-k of the
    unbiased scores over all experts as Megatron-Core does (DeepSpeed's aux_loss is topk_gating's own)."""
    if config.router_load_balancing_type == "none":
        return torch.zeros((), device=logits_SE.device)
    scores_SE = loss_scores(logits_SE, config.score_function)
    if config.router_load_balancing_type == "seq_aux_loss":
        return sequence_loss(scores_SE, config.topk, num_sequences, group)
    return load_balancing_loss(scores_SE, scores_SE.topk(config.topk, dim=-1).indices.flatten(), config.topk, group)
