"""The optimizer a runtime config names, built as DeepSpeed builds it: torch's fused Adam/AdamW,
Lamb, the native CPU Adam when the optimizer is offloaded to the CPU, the NVMe-swapped Adam when it
is offloaded to NVMe."""

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from megatron.errors import ConfigError
from megatron.parallel import ParallelGrid
from megatron.placement import expert_ids
from megatron.runtime.config.schema import RuntimeConfig
from megatron.runtime.optim.compressed import CompressedOptimizer
from megatron.runtime.optim.cpu_adam import CPUAdam
from megatron.runtime.optim.lamb import Lamb
from megatron.runtime.optim.onebit_adam import OneBitAdam
from megatron.runtime.optim.onebit_lamb import OneBitLamb
from megatron.runtime.optim.zero_one_adam import ZeroOneAdam
from megatron.runtime.swap.swapped_adam import SwappedAdam

COMPRESSED: dict[str, type[CompressedOptimizer]] = {
    "OneBitAdam": OneBitAdam,
    "ZeroOneAdam": ZeroOneAdam,
    "OneBitLamb": OneBitLamb,
}


def build_optimizer(
    model: nn.Module,
    config: RuntimeConfig,
    model_parameters: Iterable[Any] | None = None,
    rank: int = 0,
    grid: ParallelGrid | None = None,
) -> torch.optim.Optimizer:
    """The config's optimizer over `model_parameters` as DeepSpeed builds it: groups of parameters
    kept as given, or a list of parameters as one group. Without them: the model's trainable
    parameters with weight decay on matrices only (biases and norm weights are not decayed)."""
    params = config.optimizer.params.given()  # the optimizer's own defaults are DeepSpeed's
    weight_decay = params.pop("weight_decay", 0.0)
    adam_w_mode = params.pop("adam_w_mode", True)
    given = list(model_parameters) if model_parameters is not None else []
    if given and not isinstance(given[0], dict):
        given = [{"params": given}]
    if given:
        groups = [{**g, "params": [p for p in g["params"] if p.requires_grad]} for g in given]
        groups = [{"weight_decay": weight_decay, **g} for g in groups]
    else:
        trainable = [p for p in model.parameters() if p.requires_grad]
        # a stacked expert tensor has one leading dimension more than the tensor of one expert
        is_matrix = {p: p.dim() - (expert_ids(p) is not None) >= 2 for p in trainable}
        groups = [
            {"params": [p for p in trainable if is_matrix[p]], "weight_decay": weight_decay},
            {"params": [p for p in trainable if not is_matrix[p]], "weight_decay": 0.0},
        ]
    groups = [g for g in groups if g["params"]]
    kind = config.optimizer.type  # its combinations with the rest were refused when it was read
    offload = config.zero_optimization.offload_optimizer
    try:
        if kind == "Lamb":
            return Lamb(groups, **params)
        if kind in COMPRESSED:  # they average tensors of their own over each parameter's replicas in `grid`
            return COMPRESSED[kind](groups, grid=grid, **params)
        if offload.device != "none":
            if next(model.parameters()).device.type != "cpu":
                raise ConfigError(
                    f"offload_optimizer to {offload.device} is implemented for CPU training only so far; "
                    'set offload_optimizer.device to "none" on an accelerator'
                )
            adam = {**params, "adamw_mode": kind == "AdamW" or adam_w_mode}
            if offload.device == "cpu":
                return CPUAdam(groups, **adam)
            return SwappedAdam(groups, offload, config.aio, config.zero_optimization.sub_group_size, rank, **adam)
        params.pop("bias_correction", None)  # true: what torch's Adam does
        optimizer_class = torch.optim.AdamW if kind == "AdamW" or adam_w_mode else torch.optim.Adam
        return optimizer_class(groups, fused=True, **params)
    except (TypeError, NotImplementedError) as error:
        raise ConfigError(
            f"bad optimizer.params for {kind}: {error}; use the parameter names of DeepSpeed's {kind}"
        ) from None
