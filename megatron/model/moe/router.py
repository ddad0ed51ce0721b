"""Routing: which experts each token goes to, with what gate, in which capacity slot.

Legend: S tokens on this rank, E experts in the layer (all ranks), K = top-k, C capacity.
The rules are DeepSpeed-MoE's (top-1, top-2, top-k gating), so its recipes carry over, unless a
Megatron-Core routing option is set (`MoEConfig.megatron_core_routing`): then scoring.py chooses
the experts and gates, and the capacity applies after the choice, as in Megatron-Core. The
implementation sorts instead of building S x E x C one-hot tensors.
"""

import math
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron.model.moe.balancing import balancing_loss, load_balancing_loss, loss_scores
from megatron.model.moe.config import DROP_POLICIES, MoEConfig
from megatron.model.moe.scoring import score_topk


class Gating(NamedTuple):
    l_aux: torch.Tensor  # scalar load-balancing loss
    expert_ids: torch.Tensor  # [S, K] long
    gates: torch.Tensor  # [S, K] fp32, 0 where dropped
    positions: torch.Tensor  # [S, K] long, slot within the expert, -1 where dropped
    tokens_per_expert: torch.Tensor  # [E] long, counted before dropping


def capacity(num_tokens: int, num_experts: int, k: int, capacity_factor: float, min_capacity: int) -> int:
    """DeepSpeed's ceil(tokens / experts x (capacity_factor x k)), with its float32 product: in float64
    the result differs by one for factors such as 1.1 and 1.2 (110 tokens' capacity from 100 x 1.1)."""
    per_expert = np.float32(num_tokens / num_experts) * np.float32(capacity_factor * k)
    return max(math.ceil(per_expert), min_capacity)


def rank_within_group(group_ids_N: torch.Tensor, num_groups: int) -> torch.Tensor:
    """For items in their given order, each item's rank among the earlier items of its group."""
    order = torch.argsort(group_ids_N, stable=True)
    counts = torch.bincount(group_ids_N, minlength=num_groups)
    starts = torch.cumsum(counts, 0) - counts
    ranks = torch.empty_like(group_ids_N)
    ranks[order] = torch.arange(len(group_ids_N), device=group_ids_N.device) - starts[group_ids_N[order]]
    return ranks


def keep_highest(expert_N: torch.Tensor, priority_N: torch.Tensor, num_experts: int, cap: int) -> torch.Tensor:
    """Per expert, keep the `cap` items of highest priority."""
    by_priority = torch.argsort(priority_N, descending=True, stable=True)
    ranks = torch.empty_like(expert_N)
    ranks[by_priority] = rank_within_group(expert_N[by_priority], num_experts)
    return ranks < cap


def slots_of_kept(expert_N: torch.Tensor, keep_N: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Slot of each kept item within its expert (kept items in order), -1 for dropped ones."""
    slots = torch.full_like(expert_N, -1)
    slots[keep_N] = rank_within_group(expert_N[keep_N], num_experts)
    return slots


def within_capacity(
    expert_N: torch.Tensor, priority_N: torch.Tensor, num_experts: int, cap: int | None, drop_policy: str
) -> torch.Tensor:
    """Which choices (token-major) the experts keep: all without a capacity, else per expert the
    `cap` of highest priority ("probs") or the first `cap` in token order ("position")."""
    if cap is None:
        return torch.ones_like(expert_N, dtype=torch.bool)
    if drop_policy == "probs":
        return keep_highest(expert_N, priority_N, num_experts, cap)
    return rank_within_group(expert_N, num_experts) < cap


def gumbel_like(x: torch.Tensor) -> torch.Tensor:
    return -torch.empty_like(x).exponential_().log()


def topk_gating(
    logits: torch.Tensor,
    k: int,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool = True,
    use_rts: bool = False,
    noisy_gate_policy: str | None = None,
    sample_second_expert: bool = False,
    ep_group: dist.ProcessGroup | None = None,
    drop_policy: str = "probs",
    sequence_group: dist.ProcessGroup | None = None,
) -> Gating:
    """Route S tokens given router logits [S, E]. Everything here is fp32.

    `drop_policy` is DeepSpeed's for k >= 3: an over-full expert keeps the choices of highest gate
    probability ("probs") or of the earliest tokens ("position").

    `ep_group` is accepted for DeepSpeed's signature: without dropping, DeepSpeed max-reduces the
    capacity over the expert-parallel group to size its padded buffers; the sort dispatcher
    sends exactly the routed tokens, so keeping every token needs no common capacity.

    `sequence_group`: the ranks that share each sequence's positions (sequence parallelism); the
    auxiliary loss is then the whole sequences', while the capacity counts this rank's tokens, as in
    Megatron-Core.
    """
    logits_SE = logits.float()
    num_tokens, num_experts = logits_SE.shape
    gates_SE = F.softmax(logits_SE, dim=1)
    cap = capacity(num_tokens, num_experts, k, capacity_factor, min_capacity)
    token_S = torch.arange(num_tokens, device=logits.device)
    if k == 1:
        scores = logits_SE + gumbel_like(logits_SE) if noisy_gate_policy == "RSample" else gates_SE
        expert_S = scores.argmax(dim=1)
        l_aux = load_balancing_loss(gates_SE, expert_S, 1, sequence_group)
        keep_S = torch.ones_like(expert_S, dtype=torch.bool)
        if drop_tokens:
            priority = torch.rand(num_tokens, device=logits.device) if use_rts else -token_S.float()
            keep_S = keep_highest(expert_S, priority, num_experts, cap)
        gate_S = gates_SE[token_S, expert_S] * keep_S  # a kept token's gate is not renormalised
        return Gating(
            l_aux,
            expert_S[:, None],
            gate_S[:, None],
            slots_of_kept(expert_S, keep_S, num_experts)[:, None],
            torch.bincount(expert_S, minlength=num_experts),
        )
    if k == 2:
        first_S = gates_SE.argmax(dim=1)
        second_logits = logits_SE + gumbel_like(logits_SE) if sample_second_expert else logits_SE
        second_S = second_logits.scatter(1, first_S[:, None], float("-inf")).argmax(dim=1)
        l_aux = load_balancing_loss(gates_SE, first_S, 1, sequence_group)
        first_counts_E = torch.bincount(first_S, minlength=num_experts)
        # every first choice takes its slot before any second choice, each in token order
        slots_S2 = torch.stack(
            [
                rank_within_group(first_S, num_experts),
                rank_within_group(second_S, num_experts) + first_counts_E[second_S],
            ],
            dim=1,
        )
        expert_S2 = torch.stack([first_S, second_S], dim=1)
        keep_S2 = slots_S2 < cap if drop_tokens else torch.ones_like(slots_S2, dtype=torch.bool)
        gate_S2 = gates_SE.gather(1, expert_S2) * keep_S2
        gate_S2 = gate_S2 / gate_S2.sum(dim=1, keepdim=True).clamp(min=torch.finfo(torch.float32).eps)
        return Gating(
            l_aux,
            expert_S2,
            gate_S2,
            torch.where(keep_S2, slots_S2, -1),
            torch.bincount(expert_S2.flatten(), minlength=num_experts),
        )
    if drop_policy not in DROP_POLICIES:
        raise ValueError(f"unknown drop_policy {drop_policy!r}; use probs or position")
    probs_SK, expert_SK = torch.topk(gates_SE, k, dim=1)
    l_aux = load_balancing_loss(gates_SE, expert_SK.flatten(), k, sequence_group)
    keep_N = within_capacity(
        expert_SK.flatten(), probs_SK.flatten(), num_experts, cap if drop_tokens else None, drop_policy
    )
    gate_SK = probs_SK * keep_N.view(num_tokens, k)
    gate_SK = gate_SK / gate_SK.sum(dim=1, keepdim=True).clamp(min=torch.finfo(torch.float32).eps)
    return Gating(
        l_aux,
        expert_SK,
        gate_SK,
        slots_of_kept(expert_SK.flatten(), keep_N, num_experts).view(num_tokens, k),
        torch.bincount(expert_SK.flatten(), minlength=num_experts),
    )


def capacity_gating(
    expert_SK: torch.Tensor,
    gates_SK: torch.Tensor,
    num_experts: int,
    cap: int | None,
    drop_policy: str,
    l_aux: torch.Tensor,
) -> Gating:
    """Megatron-Core's capacity, applied after the choice: an over-full expert keeps the choices of
    highest gate ("probs") or of the earliest tokens ("position"); the others' gates become 0 and the
    kept gates are not renormalised. `cap` None: dropless."""
    num_tokens, k = expert_SK.shape
    expert_N = expert_SK.flatten()
    keep_N = within_capacity(expert_N, gates_SK.flatten(), num_experts, cap, drop_policy)
    return Gating(
        l_aux,
        expert_SK,
        gates_SK * keep_N.view(num_tokens, k),
        slots_of_kept(expert_N, keep_N, num_experts).view(num_tokens, k),
        torch.bincount(expert_N, minlength=num_experts),
    )


class Router(nn.Module):
    """Linear(h, E, bias=False) in fp32 whatever the model dtype, then DeepSpeed's `topk_gating` or
    Megatron-Core's top-k routing (`score_topk`, then `capacity_gating`). Training adds the configured
    noise and random selection; evaluation is deterministic.

    With `router_enable_expert_bias` the router holds `expert_bias` [E] (fp32, saved with the model,
    moved by expert_bias.py after each optimizer step, never by gradients) and counts the choices per
    expert of its training forwards in `local_tokens_per_expert` until then. A forward that activation
    checkpointing recomputes counts twice, which leaves the sign of every update as it is.
    """

    def __init__(self, hidden_size: int, num_experts: int, config: MoEConfig) -> None:
        super().__init__()
        config.check_experts(num_experts)
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))  # torch's Linear default, as DeepSpeed's gate
        self.config = config
        biased = config.router_enable_expert_bias
        self.register_buffer("expert_bias", torch.zeros(num_experts) if biased else None)
        self.register_buffer(
            "local_tokens_per_expert", torch.zeros(num_experts, dtype=torch.long) if biased else None, persistent=False
        )

    def forward(
        self,
        x_SH: torch.Tensor,
        ep_group: dist.ProcessGroup | None = None,
        num_sequences: int = 1,
        sequence_group: dist.ProcessGroup | None = None,
    ) -> tuple[Gating, torch.Tensor]:
        """Returns the gating and the router logits [S, E] (fp32). The S tokens are `num_sequences`
        sequences one after the other (for seq_aux_loss), or under sequence parallelism this rank's
        share of each, the rest on the other ranks of `sequence_group`."""
        c = self.config
        with torch.autocast(device_type=x_SH.device.type, enabled=False):
            x_SH = x_SH.float()
            if self.training and c.noisy_gate_policy == "Jitter":
                x_SH = x_SH * torch.empty_like(x_SH).uniform_(0.99, 1.01)
            logits_SE = F.linear(x_SH, self.weight.float())
        gating = self._route(logits_SE, ep_group, num_sequences, sequence_group)
        if self.local_tokens_per_expert is not None and self.training and torch.is_grad_enabled():
            self.local_tokens_per_expert += gating.tokens_per_expert
        return gating, logits_SE

    def _route(
        self,
        logits_SE: torch.Tensor,
        ep_group: dist.ProcessGroup | None,
        num_sequences: int,
        sequence_group: dist.ProcessGroup | None,
    ) -> Gating:
        c = self.config
        capacity_factor = c.train_capacity_factor if self.training else c.eval_capacity_factor
        if not c.megatron_core_routing:
            gating = topk_gating(
                logits_SE,
                c.topk,
                capacity_factor,
                c.min_capacity,
                drop_tokens=c.drop_tokens,
                use_rts=c.use_rts and self.training,
                noisy_gate_policy=c.noisy_gate_policy if self.training else None,
                sample_second_expert=c.sample_second_expert and self.training,
                ep_group=ep_group,
                drop_policy=c.drop_policy,
                sequence_group=sequence_group,
            )
            if c.router_load_balancing_type == "aux_loss":  # DeepSpeed's own
                return gating
            return gating._replace(l_aux=balancing_loss(logits_SE, c, num_sequences, sequence_group))
        gates_SK, expert_SK = score_topk(logits_SE, c, self.expert_bias)
        num_tokens, num_experts = logits_SE.shape
        cap = capacity(num_tokens, num_experts, c.topk, capacity_factor, c.min_capacity) if c.drop_tokens else None
        return capacity_gating(
            expert_SK,
            gates_SK,
            num_experts,
            cap,
            c.drop_policy,
            balancing_loss(logits_SE, c, num_sequences, sequence_group),
        )

    def probabilities(self, logits_SE: torch.Tensor) -> torch.Tensor:
        """Each token's probabilities over all experts [S, E] as the balancing losses see them (for the
        router-entropy statistic)."""
        return loss_scores(logits_SE, self.config.score_function)
