"""The model's own frozen config: shapes, dropout and initialisation, nothing about training."""

from dataclasses import dataclass

from megatron.errors import ConfigError


@dataclass(frozen=True)
class GPTConfig:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    # padded to a multiple of --make-vocab-size-divisible-by; None until the tokenizer is known
    vocab_size: int | None
    max_position_embeddings: int
    ffn_hidden_size: int | None = None  # None means 4 * hidden_size, as in Megatron
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    init_method_std: float = 0.02
    layernorm_epsilon: float = 1e-5
    position_embedding_type: str = "learned_absolute"  # or "rope"
    rotary_base: float = 10000.0
    checkpoint_activations: bool = False

    def __post_init__(self) -> None:
        if self.ffn_hidden_size is None:
            object.__setattr__(self, "ffn_hidden_size", 4 * self.hidden_size)
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"hidden size {self.hidden_size} is not divisible by {self.num_attention_heads} "
                "attention heads; choose sizes where --hidden-size % --num-attention-heads == 0"
            )
        if self.position_embedding_type not in ("learned_absolute", "rope"):
            raise ConfigError(
                f"unknown position embedding type {self.position_embedding_type!r}; "
                "use learned_absolute or rope"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def flops_per_token(self, seq_length: int) -> float:
        """Training FLOPs per token (forward + backward = 3x forward), Megatron's model-FLOPs
        count: every matmul of the blocks and the LM head, attention over the full sequence."""
        h, f, layers = self.hidden_size, self.ffn_hidden_size, self.num_layers
        per_layer = 2 * (4 * h * h + 2 * h * f) + 2 * 2 * seq_length * h
        forward = layers * per_layer + 2 * h * self.vocab_size
        return 3.0 * forward
