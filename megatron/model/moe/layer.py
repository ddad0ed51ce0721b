"""The MoE layer: router -> dispatch (sort, all-to-all) -> grouped experts -> combine, with an
optional PR-MoE residual MLP or shared experts. Self-contained: it takes its expert-parallel group explicitly and
knows nothing of training, checkpoints or the engine. Under sequence parallelism (`sequence_group`)
each rank routes its share of every sequence: the balancing and z-losses are the whole sequences',
and the gradients of the layer's dense weights (router, residual MLP, shared experts), which see
only this rank's tokens, are summed over the group. Experts see every rank's tokens through the
expert-parallel all-to-all, or are summed over their expert-data-parallel group. Under expert tensor
parallelism each expert's hidden features are split over `expert_tp_group`, which computes the rows
of all its ranks together.

Legend: B batch, S sequence, H hidden, T = B * S tokens, E experts in the layer.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron.errors import ConfigError
from megatron.model.moe.balancing import token_mean
from megatron.model.moe.config import MoEConfig
from megatron.model.moe.dispatch import (
    combine,
    exchange_counts,
    return_from_expert_ranks,
    route_by_expert,
    send_to_expert_ranks,
    sort_by_expert,
)
from megatron.model.moe.experts import GroupedExperts
from megatron.model.moe.router import Gating, Router
from megatron.model.tensor_parallel import sum_gradient_over


@dataclass
class RoutingStats:
    """What users watch of one forward's routing: load per expert, dropped choices, router entropy."""

    tokens_per_expert_E: torch.Tensor
    dropped: torch.Tensor  # routed choices past their expert's capacity
    routed: torch.Tensor  # routed choices, T * k
    entropy_sum: torch.Tensor  # router entropy summed over tokens, nats
    tokens: torch.Tensor
    l_aux: torch.Tensor  # the balancing loss before its coefficient


@dataclass
class MoEOutput:
    hidden_BSH: torch.Tensor
    router_loss: torch.Tensor  # this layer's weighted aux + z-loss
    routing: RoutingStats


class MoELayer(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        num_experts: int,
        config: MoEConfig,
        init_std: float,
        output_init_std: float,
        ep_group: dist.ProcessGroup | None = None,
        residual_mlp: nn.Module | None = None,
        shared_expert: nn.Module | None = None,
        swiglu: bool = False,
        bias: bool = True,
        sequence_group: dist.ProcessGroup | None = None,
        expert_tp_group: dist.ProcessGroup | None = None,
    ) -> None:
        """`swiglu` and `bias` shape the experts, `expert_tp_group` splits them (see `GroupedExperts`)."""
        super().__init__()
        ep_size = dist.get_world_size(ep_group) if ep_group is not None else 1
        ep_rank = dist.get_rank(ep_group) if ep_group is not None else 0
        if num_experts % ep_size:
            raise ConfigError(
                f"{num_experts} experts cannot be split over --moe-expert-parallel-size {ep_size}; "
                "choose an expert-parallel size that divides every layer's expert count"
            )
        if config.use_residual and residual_mlp is None:
            raise ValueError("a residual MoE layer needs its dense residual_mlp")
        local = num_experts // ep_size
        self.num_experts = num_experts
        self.config = config
        self.ep_group = ep_group if ep_size > 1 else None
        self.router = Router(hidden_size, num_experts, config)
        self.experts = GroupedExperts(
            num_experts,
            list(range(ep_rank * local, (ep_rank + 1) * local)),
            hidden_size,
            ffn_hidden_size,
            init_std,
            output_init_std,
            swiglu=swiglu,
            bias=bias,
            tp_group=expert_tp_group,
        )
        self.residual_mlp = residual_mlp
        self.shared_expert = shared_expert
        self.coefficient = nn.Linear(hidden_size, 2) if config.use_residual else None
        self.sequence_group = sequence_group
        dense = [self.router, self.coefficient, self.residual_mlp, self.shared_expert]
        for param in (p for module in dense if module is not None for p in module.parameters()):
            sum_gradient_over(param, sequence_group)

    def forward(self, x_BSH: torch.Tensor) -> MoEOutput:
        """The layer's output [B, S, H], its weighted router loss and this forward's routing statistics."""
        x_TH = x_BSH.reshape(-1, x_BSH.shape[-1])
        gating, logits_TE = self.router(
            x_TH, self.ep_group, num_sequences=x_BSH.shape[0], sequence_group=self.sequence_group
        )
        # with experts on other ranks, their row counts travel while the rows are sorted
        counts = exchange_counts(gating, self.num_experts, self.ep_group) if self.ep_group is not None else None
        if counts is None:  # the experts gather their rows themselves, a block at a time
            counts_E, routes = route_by_expert(gating, self.num_experts)
            y_NH = self.experts(x_TH, counts_E, routes.token_N)
        else:
            rows_NH, _, routes = sort_by_expert(x_TH, gating, self.num_experts)
            local_rows, local_counts = send_to_expert_ranks(rows_NH, counts, routes, self.ep_group)
            y_NH = return_from_expert_ranks(self.experts(local_rows, local_counts), routes, self.ep_group)
        out_TH = combine(y_NH, routes, x_TH.shape[0])
        if self.residual_mlp is not None:
            mix_T2 = F.softmax(self.coefficient(x_TH), dim=-1)
            out_TH = out_TH * mix_T2[:, :1] + self.residual_mlp(x_TH) * mix_T2[:, 1:]
        if self.shared_expert is not None:
            out_TH = out_TH + self.shared_expert(x_TH)
        loss = self.config.aux_loss_coeff * gating.l_aux
        if self.config.z_loss_coeff > 0:
            loss = loss + self.config.z_loss_coeff * token_mean(
                torch.logsumexp(logits_TE, dim=-1).square(), 0, self.sequence_group
            )
        return MoEOutput(out_TH.view_as(x_BSH).to(x_BSH.dtype), loss, self._routing_stats(gating, logits_TE))

    @torch.no_grad()
    def _routing_stats(self, gating: Gating, logits_TE: torch.Tensor) -> RoutingStats:
        probs = self.router.probabilities(logits_TE)
        return RoutingStats(
            tokens_per_expert_E=gating.tokens_per_expert,
            dropped=(gating.positions < 0).sum(),
            routed=torch.tensor(gating.positions.numel(), device=logits_TE.device),
            entropy_sum=-(probs * probs.clamp(min=1e-20).log()).sum(),
            tokens=torch.tensor(logits_TE.shape[0], device=logits_TE.device),
            l_aux=gating.l_aux.detach(),
        )
