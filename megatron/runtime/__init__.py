"""Our small DeepSpeed: an engine that trains any torch.nn.Module from a runtime config."""

from megatron.runtime.config.schema import RuntimeConfig, load_runtime_config
from megatron.runtime.engine import Engine, initialize

__all__ = ["Engine", "RuntimeConfig", "initialize", "load_runtime_config"]
