"""The MoE layer's frozen config: routing rules and losses, as DeepSpeed-MoE defines them."""

from dataclasses import dataclass

from megatron.errors import ConfigError

NOISY_GATE_POLICIES = (None, "Jitter", "RSample")
# Which choices an over-full expert keeps under top-k routing with k >= 3 (DeepSpeed's topkgating):
# the highest gate probabilities, or the earliest tokens.
DROP_POLICIES = ("probs", "position")


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
    drop_policy: str = "probs"  # top-k with k >= 3; top-1 and top-2 keep their own rules

    def __post_init__(self) -> None:
        if self.topk < 1:
            raise ConfigError(f"--topk must be at least 1, got {self.topk}")
        if self.noisy_gate_policy not in NOISY_GATE_POLICIES:
            raise ConfigError(
                f"unknown --moe-noisy-gate-policy {self.noisy_gate_policy!r}; use None, Jitter or RSample"
            )
        if self.noisy_gate_policy == "RSample" and self.topk != 1:
            raise ConfigError("--moe-noisy-gate-policy RSample applies to top-1 routing only; use Jitter or None with --topk > 1")
        if self.drop_policy not in DROP_POLICIES:
            raise ConfigError(f"unknown MoE drop_policy {self.drop_policy!r}; use probs or position")
        if self.drop_policy != "probs" and self.topk < 3:
            raise ConfigError(
                f"MoE drop_policy {self.drop_policy!r} applies to --topk 3 or more; top-2 already keeps the "
                "earliest tokens, top-1 too with --disable-moe-rts, so leave drop_policy at probs"
            )
        if self.train_capacity_factor <= 0 or self.eval_capacity_factor <= 0:
            raise ConfigError("MoE capacity factors must be positive")
