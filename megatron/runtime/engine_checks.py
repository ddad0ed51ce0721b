"""The engine's checks of what it was given against its config, before it builds anything: the
combinations that are refused with one sentence naming the fix."""

from typing import Any

import torch

from megatron.errors import ConfigError
from megatron.runtime.config.combinations import tied_embedding_refusal
from megatron.runtime.config.schema import RuntimeConfig
from megatron.runtime.optim.cpu_adam import CPUAdam


def check_engine_inputs(
    config: RuntimeConfig, optimizer: torch.optim.Optimizer, lr_scheduler: Any, device: torch.device
) -> None:
    param_offload = config.zero_optimization.offload_param.device
    if param_offload != "none" and device.type != "cpu":
        raise ConfigError(
            f"offload_param to {param_offload} is implemented for CPU training only so far; "
            'set offload_param.device to "none" on an accelerator'
        )
    offload = config.zero_optimization.offload_optimizer.device
    if offload != "none" and not isinstance(optimizer, CPUAdam):
        raise ConfigError(
            f"offload_optimizer to {offload} needs the optimizer the config builds, but a "
            f"{type(optimizer).__name__} was passed; drop the optimizer argument or the offload block"
        )
    if lr_scheduler is not None and config.scheduler is not None:
        raise ConfigError(
            f"a scheduler object was passed and the config also names scheduler {config.scheduler.type!r}; "
            "give only one of them"
        )
    if config.activation_checkpointing.cpu_checkpointing and device.type != "cpu":
        raise ConfigError(
            "activation_checkpointing.cpu_checkpointing (checkpointed activations moved to host "
            "memory) is not built for accelerators; set it to false"
        )


def check_pipeline_sharing(config: RuntimeConfig, pipeline_shared: list[torch.nn.Parameter]) -> None:
    """A parameter shared by the first and last pipeline stages (the tied word embedding) has its
    gradient summed over them at the step, which ZeRO stages 2 and 3 would already have reduced."""
    refusal = tied_embedding_refusal(config.zero_optimization.stage)
    if pipeline_shared and refusal:
        raise ConfigError(refusal)
