"""Megatron-Core's top-k routing: which experts a token chooses and with what gates, from its
router logits, under `--moe-router-score-function`, `--moe-router-pre-softmax`,
`--moe-router-topk-scaling-factor`, the expert bias and group-limited routing. Capacity and the
balancing losses come after (router.py, balancing.py).

Legend: S tokens, E experts, K = top-k, G expert groups.

Which flags reproduce which Hugging Face router exactly (dropless, i.e. with
--disable-moe-token-dropping; same experts, gates equal to fp32 round-off):

- MixtralSparseMoeBlock, and Qwen2MoeSparseMoeBlock with norm_topk_prob=True (k >= 2):
  `--moe-router-score-function softmax`. A softmax over the k chosen logits equals the k largest
  softmax probabilities divided by their sum. With k = 1 Hugging Face's gate is 1: Megatron-Core
  refuses that (the router would get no gradient), so it has no equivalent here.
- Qwen2MoeSparseMoeBlock with norm_topk_prob=False: `--moe-router-pre-softmax` (the k largest
  softmax probabilities as they are). With k = 1 DeepSpeed's top-1 gating (no flag) is the same.
- Glm4MoeTopkRouter and DeepseekV3TopkRouter: `--moe-router-score-function sigmoid`, with
  `--moe-router-topk-scaling-factor` = routed_scaling_factor, `--moe-router-enable-expert-bias`
  (expert_bias = e_score_correction_bias; without the flag the bias is zero), and
  `--disable-moe-router-norm-topk-prob` where norm_topk_prob=False. n_group = 1 needs no group
  flags; n_group > 1 is `--moe-router-num-groups n_group --moe-router-group-topk topk_group`,
  exact when topk = 2 x topk_group or topk_group = n_group: Hugging Face scores a group by its two
  best experts, Megatron-Core by its best topk / group_topk. With k = 1 and norm_topk_prob=True
  Hugging Face's gate is 1 while Megatron-Core keeps the sigmoid score: no equivalent.
"""

import torch

from megatron.model.moe.config import MoEConfig


def group_limited_topk(
    scores_SE: torch.Tensor, k: int, num_groups: int, group_topk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k among the experts of each token's `group_topk` best groups, a group scored by the
    sum of its best k / group_topk experts (DeepSeek-V2/V3's device- and node-limited routing)."""
    num_tokens, num_experts = scores_SE.shape
    scores_SGe = scores_SE.view(num_tokens, num_groups, num_experts // num_groups)
    group_scores_SG = scores_SGe.topk(k // group_topk, dim=-1).values.sum(dim=-1)
    groups_S = group_scores_SG.topk(group_topk, dim=-1).indices
    allowed_SG = torch.zeros_like(group_scores_SG, dtype=torch.bool).scatter(1, groups_S, True)
    allowed_SE = allowed_SG.unsqueeze(-1).expand_as(scores_SGe).reshape(num_tokens, num_experts)
    return scores_SE.masked_fill(~allowed_SE, float("-inf")).topk(k, dim=-1)


def select_topk(scores_SE: torch.Tensor, config: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best scores and their experts, within the allowed groups when routing is group-limited."""
    if config.router_group_topk is not None:
        return group_limited_topk(scores_SE, config.topk, config.router_num_groups, config.router_group_topk)
    return scores_SE.topk(config.topk, dim=-1)


def score_topk(
    logits_SE: torch.Tensor, config: MoEConfig, expert_bias_E: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gates [S, K] (fp32) and chosen experts [S, K] of Megatron-Core's `topk_routing_with_score_function`.

    softmax: the softmax of the k largest logits (normalised), or with pre-softmax the k largest
    softmax probabilities over all experts. sigmoid: the k best sigmoid scores, chosen with the
    expert bias added but gated without it, divided by their sum when k > 1. Then the scaling factor.
    """
    logits_SE = logits_SE.float()
    if config.score_function == "softmax":
        if config.router_pre_softmax:
            gates_SK, expert_SK = select_topk(torch.softmax(logits_SE, dim=-1), config)
        else:
            top_logits_SK, expert_SK = select_topk(logits_SE, config)
            gates_SK = torch.softmax(top_logits_SK, dim=-1)
    else:
        scores_SE = torch.sigmoid(logits_SE)
        choice_SE = scores_SE if expert_bias_E is None else scores_SE + expert_bias_E.float()
        expert_SK = select_topk(choice_SE, config)[1]
        gates_SK = scores_SE.gather(1, expert_SK)
        if config.topk > 1 and config.router_norm_topk_prob:
            gates_SK = gates_SK / (gates_SK.sum(dim=-1, keepdim=True) + 1e-20)  # Megatron-Core's and HF's epsilon
    if config.router_topk_scaling_factor is not None:
        gates_SK = gates_SK * config.router_topk_scaling_factor
    return gates_SK, expert_SK
