"""Mixture-of-Experts: router, dispatcher, grouped experts and the layer that joins them."""

from megatron.model.moe.config import MoEConfig
from megatron.model.moe.layer import MoELayer
from megatron.model.moe.router import Gating, topk_gating

__all__ = ["Gating", "MoEConfig", "MoELayer", "topk_gating"]
