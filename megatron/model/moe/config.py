"""The MoE layer's frozen config: routing rules and losses, as DeepSpeed-MoE defines them."""

from dataclasses import dataclass

from megatron.errors import ConfigError

NOISY_GATE_POLICIES = (None, "Jitter", "RSample")


@dataclass(frozen=True)
class MoEConfig:
    topk: int = 1
    train_capacity_factor: float = 1.0
    eval_capacity_factor: float = 1.0
    min_capacity: int = 4
    drop_tokens: bool = True
    use_rts: bool = True  # random token selection (top-1)
    noisy_gate_policy: str | None = None
    sample_second_expert: bool = True  # Gumbel noise on the top-2 second choice, in training
    aux_loss_coeff: float = 0.01
    z_loss_coeff: float = 0.0
    use_residual: bool = False  # PR-MoE: a dense MLP beside the experts, mixed per token

    def __post_init__(self) -> None:
        if self.topk < 1:
            raise ConfigError(f"--topk must be at least 1, got {self.topk}")
        if self.noisy_gate_policy not in NOISY_GATE_POLICIES:
            raise ConfigError(
                f"unknown --moe-noisy-gate-policy {self.noisy_gate_policy!r}; use None, Jitter or RSample"
            )
        if self.noisy_gate_policy == "RSample" and self.topk != 1:
            raise ConfigError("--moe-noisy-gate-policy RSample applies to top-1 routing only; use Jitter or None with --topk > 1")
        if self.train_capacity_factor <= 0 or self.eval_capacity_factor <= 0:
            raise ConfigError("MoE capacity factors must be positive")
