"""The model's own frozen config: shapes, dropout and initialisation, nothing about training."""

from dataclasses import dataclass

from megatron.errors import ConfigError
from megatron.model.moe.config import MoEConfig

MLP_TYPES = ("standard", "residual")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "none")


@dataclass(frozen=True)
class GPTConfig:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    # padded to a multiple of --make-vocab-size-divisible-by; None until the tokenizer is known
    vocab_size: int | None
    max_position_embeddings: int
    ffn_hidden_size: int | None = None  # None means 4 * hidden_size, as in Megatron
    # each expert's ffn width (fine-grained experts); None means ffn_hidden_size
    moe_ffn_hidden_size: int | None = None
    # always-on shared experts beside the routed ones: one dense MLP of this width (None: none),
    # its output optionally scaled by a sigmoid gate per token (Qwen2-MoE)
    moe_shared_expert_intermediate_size: int | None = None
    moe_shared_expert_gate: bool = False
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    init_method_std: float = 0.02  # every weight matrix (projections into the residual scaled by 1/sqrt(2L))
    normalization: str = "LayerNorm"  # or "RMSNorm"
    norm_epsilon: float = 1e-5  # saved as layernorm_epsilon before RMSNorm existed
    swiglu: bool = False  # dense MLP: silu(first half) * second half of a 2F-wide projection
    add_bias_linear: bool = True  # False: --disable-bias-linear, no biases in attention and MLP linears
    untie_embeddings_and_output_weights: bool = False
    # GQA: the heads share this many key/value heads, stored in Megatron-LM's grouped layout;
    # None: plain multi-head attention in the original [3, N, D] layout
    num_query_groups: int | None = None
    kv_channels: int | None = None  # head dim D; None means hidden_size / num_attention_heads
    qk_layernorm: bool = False  # a norm over each head's D of queries and keys, before rope
    position_embedding_type: str = "learned_absolute"  # or "rope" or "none"
    rotary_percent: float = 1.0  # the share of each head's dims that rope rotates (the first ones)
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
        if self.moe_ffn_hidden_size is None:
            object.__setattr__(self, "moe_ffn_hidden_size", self.ffn_hidden_size)
        if self.normalization not in NORMALIZATIONS:
            raise ConfigError(f"unknown --normalization {self.normalization!r}; use LayerNorm or RMSNorm")
        self._check_attention()
        self._check_positions()
        self._check_moe()

    def _check_attention(self) -> None:
        heads, groups = self.num_attention_heads, self.num_query_groups
        if self.kv_channels is None and self.hidden_size % heads:
            raise ConfigError(
                f"hidden size {self.hidden_size} is not divisible by {heads} "
                "attention heads; choose sizes where --hidden-size % --num-attention-heads == 0, or give --kv-channels"
            )
        if groups is not None and (groups < 1 or heads % groups):
            raise ConfigError(
                f"--num-query-groups {groups} does not divide --num-attention-heads {heads}; "
                "choose a group count that divides the head count"
            )

    def _check_positions(self) -> None:
        if self.position_embedding_type not in POSITION_EMBEDDING_TYPES:
            raise ConfigError(
                f"unknown position embedding type {self.position_embedding_type!r}; use learned_absolute, rope or none"
            )
        if not 0.0 < self.rotary_percent <= 1.0:
            raise ConfigError(
                f"--rotary-percent {self.rotary_percent} is outside (0, 1]; give the share of each head's dims to "
                "rotate, such as 0.25 or 1.0"
            )
        if self.position_embedding_type != "rope" and self.rotary_percent != 1.0:
            raise ConfigError(
                f"--rotary-percent applies to rotary embeddings only, but the position embedding type is "
                f"{self.position_embedding_type}; add --position-embedding-type rope or drop --rotary-percent"
            )
        if self.position_embedding_type == "rope" and (self.rotary_dims == 0 or self.rotary_dims % 2):
            raise ConfigError(
                f"--rotary-percent {self.rotary_percent} of head dim {self.head_dim} rotates {self.rotary_dims} dims, "
                "but rope rotates pairs of dims; choose --rotary-percent or --kv-channels so that the count is even"
            )

    def _check_moe(self) -> None:
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
        self._check_shared_experts()
        for count in set(self.experts_per_layer) - {1}:  # the group rules depend on each MoE layer's expert count
            self.moe.check_experts(count)

    def _check_shared_experts(self) -> None:
        shared = self.moe_shared_expert_intermediate_size
        if self.moe_shared_expert_gate and shared is None:
            raise ConfigError(
                "--moe-shared-expert-gate gates the shared experts; add --moe-shared-expert-intermediate-size"
            )
        if shared is not None and not self.is_moe:
            raise ConfigError(
                "--moe-shared-expert-intermediate-size adds shared experts to MoE layers, but this model has none; "
                "give --num-experts greater than 1 or drop the flag"
            )
        if shared is not None and self.mlp_type == "residual":
            raise ConfigError(
                "--mlp-type residual and --moe-shared-expert-intermediate-size both put a dense MLP beside the "
                "experts; choose one (PR-MoE mixes it in with learned coefficients, shared experts add it)"
            )

    def differences(self, other: "GPTConfig", fields: tuple[str, ...]) -> list[str]:
        """ "name <other's> there, <ours> here" for each of `fields` where `other` (a checkpoint's) differs."""
        return [
            f"{name} {getattr(other, name)} there, {getattr(self, name)} here"
            for name in fields
            if getattr(self, name) != getattr(other, name)
        ]

    @property
    def experts_per_layer(self) -> list[int]:
        """Expert count of each layer, 1 for a dense MLP layer."""
        counts = iter(
            self.num_experts * (self.num_layers // self.expert_interval)
            if len(self.num_experts) == 1
            else self.num_experts
        )
        return [next(counts) if (n + 1) % self.expert_interval == 0 else 1 for n in range(self.num_layers)]

    @property
    def is_moe(self) -> bool:
        return any(count > 1 for count in self.experts_per_layer)

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads: the query groups under GQA, else one per attention head."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def rotary_dims(self) -> int:
        """The leading dims of each head that rope rotates, rounded down as Megatron-LM and GPT-NeoX do."""
        return int(self.head_dim * self.rotary_percent)

    def flops_per_token(self, seq_length: int) -> float:
        """Training FLOPs per token (forward + backward = 3x forward), Megatron's model-FLOPs
        count of active parameters: every matmul a token goes through (k experts, the router,
        the residual MLP and its mixer in MoE layers), attention over the full sequence, LM head."""
        h, f = self.hidden_size, self.ffn_hidden_size
        queries, keys_values = self.num_attention_heads * self.head_dim, 2 * self.kv_heads * self.head_dim
        attention = 2 * h * (queries + keys_values) + 2 * queries * h + 2 * 2 * seq_length * queries

        def mlp_flops(width: int) -> int:  # dense layers, PR-MoE's residual, shared and routed experts
            return 2 * (3 if self.swiglu else 2) * h * width

        mlp = mlp_flops(f)
        expert = mlp_flops(self.moe_ffn_hidden_size)
        forward = 2 * h * self.vocab_size
        for experts in self.experts_per_layer:
            forward += attention
            if experts == 1:
                forward += mlp
            else:
                forward += self.moe.topk * expert + 2 * h * experts
                if self.moe_shared_expert_intermediate_size is not None:
                    forward += mlp_flops(self.moe_shared_expert_intermediate_size) + 2 * h * self.moe_shared_expert_gate
                forward += mlp + 2 * h * 2 if self.mlp_type == "residual" else 0
        return 3.0 * forward
