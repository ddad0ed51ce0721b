"""The MoE layer's frozen config: routing rules and losses, as DeepSpeed-MoE defines them, and
Megatron-Core's top-k routing options (`--moe-router-*`)."""

from dataclasses import dataclass

from megatron.errors import ConfigError

NOISY_GATE_POLICIES = (None, "Jitter", "RSample")
# Which choices an over-full expert keeps under top-k routing with k >= 3 (DeepSpeed's topkgating):
# the highest gate probabilities, or the earliest tokens.
DROP_POLICIES = ("probs", "position")
SCORE_FUNCTIONS = ("softmax", "sigmoid")
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "none")


@dataclass(frozen=True)
class MoEConfig:
    topk: int = 1
    train_capacity_factor: float = 1.0
    eval_capacity_factor: float = 1.0
    min_capacity: int = 4
    drop_tokens: bool = True
    use_rts: bool = True  # random token selection (DeepSpeed's top-1)
    noisy_gate_policy: str | None = None
    sample_second_expert: bool = True  # Gumbel noise on DeepSpeed's top-2 second choice, in training
    aux_loss_coeff: float = 0.01
    z_loss_coeff: float = 0.0
    use_residual: bool = False  # PR-MoE: a dense MLP beside the experts, mixed per token
    drop_policy: str = "probs"  # DeepSpeed: top-k with k >= 3 only; Megatron-Core routing: any k
    # Megatron-Core's top-k routing (scoring.py): setting any of the next six replaces DeepSpeed's gating rules
    router_score_function: str | None = None  # None: DeepSpeed's gating (softmax)
    router_pre_softmax: bool = False  # softmax over all experts before the top-k: gates not renormalised
    router_topk_scaling_factor: float | None = None  # gates multiplied by it
    router_enable_expert_bias: bool = False  # aux-loss-free balancing: a per-expert bias for selection only
    router_num_groups: int | None = None  # group-limited routing: experts in this many equal groups ...
    router_group_topk: int | None = None  # ... of which each token may use this many
    router_norm_topk_prob: bool = True  # sigmoid, k > 1: gates divided by their sum (Hugging Face's norm_topk_prob)
    router_bias_update_rate: float = 1e-3
    router_load_balancing_type: str = "aux_loss"

    @property
    def megatron_core_routing(self) -> bool:
        """Megatron-Core's top-k routing rather than DeepSpeed's gating rules."""
        return (
            self.router_score_function is not None
            or self.router_pre_softmax
            or self.router_enable_expert_bias
            or self.router_topk_scaling_factor is not None
            or self.router_num_groups is not None
            or self.router_group_topk is not None
        )

    @property
    def score_function(self) -> str:
        return self.router_score_function or "softmax"

    @property
    def gate_sum(self) -> float | None:
        """What each token's gates add up to over its k experts (dropless) when that is the same for
        every token (the gates are normalised), else None (DeepSpeed's top-1 and pre-softmax keep the
        router probabilities, unnormalised sigmoid its scores)."""
        if not self.megatron_core_routing:
            return 1.0 if self.topk > 1 else None
        sigmoid = self.score_function == "sigmoid"
        if self.router_pre_softmax or (sigmoid and (self.topk == 1 or not self.router_norm_topk_prob)):
            return None
        return self.router_topk_scaling_factor or 1.0

    def __post_init__(self) -> None:
        if self.topk < 1:
            raise ConfigError(f"--topk must be at least 1, got {self.topk}")
        if self.noisy_gate_policy not in NOISY_GATE_POLICIES:
            raise ConfigError(
                f"unknown --moe-noisy-gate-policy {self.noisy_gate_policy!r}; use None, Jitter or RSample"
            )
        if self.noisy_gate_policy == "RSample" and self.topk != 1:
            raise ConfigError(
                "--moe-noisy-gate-policy RSample applies to top-1 routing only; use Jitter or None with --topk > 1"
            )
        if self.drop_policy not in DROP_POLICIES:
            raise ConfigError(f"unknown MoE drop_policy {self.drop_policy!r}; use probs or position")
        if self.drop_policy != "probs" and self.topk < 3 and not self.megatron_core_routing:
            raise ConfigError(
                f"MoE drop_policy {self.drop_policy!r} applies to --topk 3 or more; top-2 already keeps the "
                "earliest tokens, top-1 too with --disable-moe-rts, so leave drop_policy at probs"
            )
        if self.train_capacity_factor <= 0 or self.eval_capacity_factor <= 0:
            raise ConfigError("MoE capacity factors must be positive")
        self._check_router_options()

    def _check_router_options(self) -> None:
        """Megatron-Core's rules for its routing options, plus the DeepSpeed options it has no use for."""
        if self.router_score_function not in (None, *SCORE_FUNCTIONS):
            raise ConfigError(
                f"unknown --moe-router-score-function {self.router_score_function!r}; use softmax or sigmoid"
            )
        if self.router_load_balancing_type not in LOAD_BALANCING_TYPES:
            raise ConfigError(
                f"unknown --moe-router-load-balancing-type {self.router_load_balancing_type!r}; "
                "use aux_loss, seq_aux_loss or none"
            )
        sigmoid = self.score_function == "sigmoid"
        if self.router_pre_softmax and sigmoid:
            raise ConfigError(
                "--moe-router-pre-softmax applies to softmax scores; drop it with "
                "--moe-router-score-function sigmoid, whose scores are always taken before the top-k"
            )
        if not self.router_norm_topk_prob and not sigmoid:
            raise ConfigError(
                "--disable-moe-router-norm-topk-prob applies to --moe-router-score-function sigmoid; "
                "softmax top-k probabilities stay unnormalised with --moe-router-pre-softmax instead"
            )
        if self.router_enable_expert_bias and not sigmoid:
            raise ConfigError(
                "--moe-router-enable-expert-bias needs sigmoid scores, as in Megatron-Core; "
                "add --moe-router-score-function sigmoid"
            )
        if self.router_group_topk is not None and self.router_num_groups is None:
            raise ConfigError("--moe-router-group-topk picks groups of experts; add --moe-router-num-groups")
        if self.router_num_groups is not None and self.router_group_topk is None:
            raise ConfigError(
                "--moe-router-num-groups takes effect only with --moe-router-group-topk (the groups "
                "each token may use); add it, or drop --moe-router-num-groups"
            )
        if self.router_group_topk is not None and self.router_group_topk > self.router_num_groups:
            raise ConfigError(
                f"--moe-router-group-topk {self.router_group_topk} exceeds --moe-router-num-groups "
                f"{self.router_num_groups}; pick at most that many groups"
            )
        if self.router_group_topk is not None and self.topk % self.router_group_topk:
            raise ConfigError(
                f"--topk {self.topk} is not a multiple of --moe-router-group-topk {self.router_group_topk}; "
                "each chosen group must supply the same number of experts, so choose a divisor of --topk"
            )
        if not self.megatron_core_routing:
            return
        if self.topk == 1 and not sigmoid and not self.router_pre_softmax:
            raise ConfigError(
                "top-1 softmax routing over the chosen logit alone gives every gate 1 and the router no "
                "gradient; add --moe-router-pre-softmax, as Megatron-Core asks"
            )
        if self.noisy_gate_policy == "RSample":
            raise ConfigError(
                "--moe-noisy-gate-policy RSample is DeepSpeed's top-1 gate noise, which the "
                "--moe-router-* routing does not have; use Jitter or None"
            )

    def check_experts(self, num_experts: int) -> None:
        """The group-limited routing rules that depend on a layer's expert count."""
        groups = self.router_num_groups
        if groups is None or self.router_group_topk is None:
            return
        if num_experts % groups:
            raise ConfigError(
                f"--moe-router-num-groups {groups} does not divide a layer's {num_experts} experts; "
                "choose a number of groups that divides every layer's expert count"
            )
        per_group = self.topk // self.router_group_topk
        if per_group > num_experts // groups:
            raise ConfigError(
                f"--topk {self.topk} over --moe-router-group-topk {self.router_group_topk} groups takes "
                f"{per_group} experts from a group of {num_experts // groups}; use fewer, larger groups"
            )
