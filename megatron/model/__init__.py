"""GPT model: embeddings, transformer blocks and the language-model head."""

from megatron.model.config import GPTConfig
from megatron.model.gpt import GPTModel
from megatron.model.output import GPTOutput

__all__ = ["GPTConfig", "GPTModel", "GPTOutput"]
