"""The model's own frozen config: shapes, dropout and initialisation, nothing about training."""

from dataclasses import dataclass

from megatron.errors import ConfigError
from megatron.model.moe.config import MoEConfig

MLP_TYPES = ("standard", "residual")


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
    # MoE, as Megatron-DeepSpeed's flags: one expert count for every MoE layer, or one per MoE
    # layer (a pyramid); layer n (from 1) is MoE when n % expert_interval == 0 and its count > 1
    num_experts: tuple[int, ...] = (1,)
    expert_interval: int = 2
    mlp_type: str = "standard"  # "residual": PR-MoE
    moe: MoEConfig = MoEConfig()

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

        if self.mlp_type not in MLP_TYPES:
            raise ConfigError(f"unknown --mlp-type {self.mlp_type!r}; use standard or residual")
        if self.expert_interval < 1:
            raise ConfigError(f"--expert-interval must be at least 1, got {self.expert_interval}")
        moe_layers = self.num_layers // self.expert_interval
        if len(self.num_experts) not in (1, moe_layers):
            raise ConfigError(
                f"--num-experts has {len(self.num_experts)} values but {self.num_layers} layers with "
                f"--expert-interval {self.expert_interval} have {moe_layers} MoE layers; give one value or {moe_layers}"
            )
        if self.mlp_type == "residual" and not self.is_moe:
            raise ConfigError("--mlp-type residual needs MoE layers; give --num-experts greater than 1")

    @property
    def experts_per_layer(self) -> list[int]:
        """Expert count of each layer, 1 for a dense MLP layer."""
        counts = iter(self.num_experts * (self.num_layers // self.expert_interval) if len(self.num_experts) == 1
                      else self.num_experts)
        return [next(counts) if (n + 1) % self.expert_interval == 0 else 1 for n in range(self.num_layers)]

    @property
    def is_moe(self) -> bool:
        return any(count > 1 for count in self.experts_per_layer)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def flops_per_token(self, seq_length: int) -> float:
        """Training FLOPs per token (forward + backward = 3x forward), Megatron's model-FLOPs
        count of active parameters: every matmul a token goes through (k experts, the router,
        the residual MLP and its mixer in MoE layers), attention over the full sequence, LM head."""
        h, f = self.hidden_size, self.ffn_hidden_size
        mlp = 2 * 2 * h * f
        forward = 2 * h * self.vocab_size
        for experts in self.experts_per_layer:
            forward += 2 * 4 * h * h + 2 * 2 * seq_length * h
            if experts == 1:
                forward += mlp
            else:
                forward += self.moe.topk * mlp + 2 * h * experts
                forward += mlp + 2 * h * 2 if self.mlp_type == "residual" else 0
        return 3.0 * forward
