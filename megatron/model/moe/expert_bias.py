"""Aux-loss-free load balancing (DeepSeek-V3; Megatron-Core's --moe-router-enable-expert-bias): after
each optimizer step every router's expert bias moves by a fixed rate towards an even load,
bias += rate * sign(mean load - load), the load being the choices per expert counted over all
micro-batches of the step on every rank that runs the router (the data-parallel group: the router
is replicated, so every rank applies the same update and EP=N equals EP=1).
"""

import torch
import torch.distributed as dist
from torch import nn

from megatron.model.moe.router import Router
from megatron.parallel import all_reduce


def bias_update(tokens_per_expert_E: torch.Tensor, rate: float) -> torch.Tensor:
    """Megatron-Core's get_updated_expert_bias step: +rate for the experts below the mean load,
    -rate above it, 0 at it."""
    load_E = tokens_per_expert_E.double()
    return (rate * torch.sign(load_E.mean() - load_E)).float()


@torch.no_grad()
def update_expert_biases(model: nn.Module, group: dist.ProcessGroup | None, step_taken: bool) -> None:
    """Move every biased router's expert bias by the load of the step just done (summed over
    `group`) and start counting afresh. A skipped step (fp16 overflow) moves nothing: its counts
    are dropped, as its gradients were."""
    routers = [m for m in model.modules() if isinstance(m, Router) and m.expert_bias is not None]
    if not routers:
        return
    if step_taken:
        counts_N = torch.cat([router.local_tokens_per_expert for router in routers])
        all_reduce(counts_N, group)  # one collective for all layers
        for router, load_E in zip(routers, counts_N.split([len(r.expert_bias) for r in routers])):
            router.expert_bias += bias_update(load_E, router.config.router_bias_update_rate)
    for router in routers:
        router.local_tokens_per_expert.zero_()
