"""How a model is set up to score and generate. MoE layers run dropless: with a capacity, whether a
token is dropped depends on the other tokens in the batch, so a score would change with batch
size or padding, and decoding with a KV cache (one token per step) would differ from running the
whole sequence. Without dropping (and in eval mode: no noise, no random token selection) every
token's output depends on that token's own sequence alone.
"""

from dataclasses import replace

from torch import nn

from megatron.errors import ConfigError
from megatron.model import GPTConfig
from megatron.model.moe import MoELayer


def inference_config(config: GPTConfig) -> GPTConfig:
    """The trained model's config with MoE token dropping turned off."""
    return replace(config, moe=replace(config.moe, drop_tokens=False))


def require_inference_mode(model: nn.Module) -> None:
    """Stop before scoring with a model whose outputs would depend on batch composition."""
    if model.training:
        raise ConfigError("the model is in training mode (dropout, router noise); call model.eval() before scoring")
    if any(isinstance(m, MoELayer) and m.config.drop_tokens for m in model.modules()):
        raise ConfigError(
            "the model's MoE layers drop tokens over capacity, so scores would depend on the batch; "
            "build it from inference_config(config) (dropless), as load_model does"
        )
