"""Shared experts (Megatron-Core's --moe-shared-expert-intermediate-size, Qwen2-MoE's shared_expert):
a dense MLP that every token goes through beside its routed experts, its output added to theirs,
optionally scaled per token by a sigmoid gate. Replicated on every rank like the router, so expert
parallelism leaves it alone.

Legend: T tokens, H hidden.
"""

import torch
from torch import nn


class SharedExpert(nn.Module):
    def __init__(self, mlp: nn.Module, hidden_size: int, gated: bool, init_std: float) -> None:
        super().__init__()
        self.mlp = mlp
        self.gate = nn.Linear(hidden_size, 1, bias=False) if gated else None
        if self.gate is not None:
            nn.init.normal_(self.gate.weight, mean=0.0, std=init_std)

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        out_TH = self.mlp(x_TH)
        return out_TH if self.gate is None else out_TH * torch.sigmoid(self.gate(x_TH))
