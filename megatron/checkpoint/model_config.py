"""What `--load` compares between a checkpoint's model config and the run's, field by field, as
Megatron-LM's `check_checkpoint_args` does, before a weight is read.

Every field of GPTConfig (and its MoEConfig) is in one of three tiers:

- SHAPE: which tensors exist and their shapes (layers, widths, heads, the padded vocabulary,
  positions, norms with or without a bias, experts). Loading across such a change would drop or
  misread weights, so it is refused on a resume and under --reset-iteration alike.
- MEANING: the same tensors compute something else (rope's base and share, the norm epsilon, the
  router's score function). Refused on a resume, which must continue the run that saved it;
  allowed and logged under --reset-iteration, which starts a new run from the weights (a longer
  context through another rope base, say).
- FREE: settings a resumed run may change (dropout, top-k, capacity, drop policy, noise, loss
  coefficients, activation checkpointing, the initialisation the loaded weights replace): logged
  in one line.

A field the checkpoint does not record (saved before the field existed) is compared at its
default, which is what the toolkit did before the field existed.
"""

from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from megatron.checkpoint.manifest import Manifest
from megatron.errors import CheckpointError
from megatron.model.config import GPTConfig
from megatron.model.moe.config import MoEConfig

SHAPE, MEANING, FREE = "shape", "meaning", "free"


def _shown(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(map(str, value)) + "]"
    return str(value)


def _valued(flag: str) -> Callable[[Any], str]:
    """The fix for a flag that takes a value: give the checkpoint's, or drop the flag when it was unset."""
    return lambda saved: f"drop {flag}" if saved is None else f"give {flag} {_shown(saved)}"


def _switch(flag: str, when: bool = True) -> Callable[[Any], str]:
    """The fix for a flag without a value that sets the field to `when`."""
    return lambda saved: f"add {flag}" if saved == when else f"drop {flag}"


@dataclass(frozen=True)
class Rule:
    """One compared value: `label` as the messages say it, read from a config by `value`; `covers`
    the config fields it stands for; `fix` says how to give the checkpoint's value."""

    tier: str
    label: str
    covers: tuple[str, ...]
    value: Callable[[GPTConfig], Any]
    fix: Callable[[Any], str]


def _field(tier: str, name: str, fix: Callable[[Any], str], when: Callable[[GPTConfig], bool] | None = None) -> Rule:
    """A rule on one field, compared only where `when` holds (None elsewhere, so a model where the
    field acts on nothing compares equal whatever it holds); `moe.` fields only in MoE models."""
    key = name.removeprefix("moe.")
    if name.startswith("moe."):
        when = _is_moe  # a dense model's MoE settings act on nothing

    def value(config: GPTConfig) -> Any:
        if when is not None and not when(config):
            return None
        return getattr(config.moe, key) if name.startswith("moe.") else getattr(config, name)

    return Rule(tier, name, (name,), value, fix)


def _is_moe(config: GPTConfig) -> bool:
    return config.is_moe


def _rope(config: GPTConfig) -> bool:
    return config.position_embedding_type == "rope"


def _vocabulary_fix(saved: Any) -> str:
    return (
        f"give the tokenizer flags (--tokenizer-type, --vocab-file or --tokenizer-model, --vocab-size) and the "
        f"--make-vocab-size-divisible-by of the run that saved it, which with --tensor-model-parallel-size pad "
        f"the vocabulary to {saved}"
    )


RULES: tuple[Rule, ...] = (
    _field(SHAPE, "num_layers", _valued("--num-layers")),
    _field(SHAPE, "hidden_size", _valued("--hidden-size")),
    _field(SHAPE, "num_attention_heads", _valued("--num-attention-heads")),
    Rule(SHAPE, "padded vocabulary size", ("vocab_size",), lambda config: config.vocab_size, _vocabulary_fix),
    Rule(
        SHAPE,
        "experts per layer",
        ("num_experts", "expert_interval"),
        lambda config: config.experts_per_layer,
        lambda saved: f"give the --num-experts and --expert-interval that make {_shown(saved)}",
    ),
    _field(SHAPE, "position_embedding_type", _valued("--position-embedding-type")),
    # positions are weights only when learned: rope and none have no tensor that holds them
    _field(
        SHAPE,
        "max_position_embeddings",
        _valued("--max-position-embeddings"),
        when=lambda config: config.position_embedding_type == "learned_absolute",
    ),
    _field(SHAPE, "ffn_hidden_size", _valued("--ffn-hidden-size")),
    # a dense model's expert width is its ffn width, whatever was given
    _field(SHAPE, "moe_ffn_hidden_size", _valued("--moe-ffn-hidden-size"), when=_is_moe),
    _field(SHAPE, "moe_shared_expert_intermediate_size", _valued("--moe-shared-expert-intermediate-size")),
    _field(SHAPE, "moe_shared_expert_gate", _switch("--moe-shared-expert-gate")),
    _field(SHAPE, "normalization", _valued("--normalization")),
    _field(SHAPE, "swiglu", _switch("--swiglu")),
    _field(SHAPE, "add_bias_linear", _switch("--disable-bias-linear", when=False)),
    _field(SHAPE, "untie_embeddings_and_output_weights", _switch("--untie-embeddings-and-output-weights")),
    # GQA's grouped QKV layout differs from plain attention's even with one group per head
    Rule(
        SHAPE,
        "num_query_groups",
        ("num_query_groups",),
        lambda config: config.num_query_groups,
        lambda saved: (
            "drop --group-query-attention"
            if saved is None
            else f"give --group-query-attention --num-query-groups {saved}"
        ),
    ),
    # the head dim, given or hidden_size / heads
    Rule(SHAPE, "kv_channels", ("kv_channels",), lambda config: config.head_dim, _valued("--kv-channels")),
    _field(SHAPE, "qk_layernorm", _switch("--qk-layernorm")),
    Rule(SHAPE, "mlp_type", ("mlp_type", "moe.use_residual"), lambda config: config.mlp_type, _valued("--mlp-type")),
    _field(SHAPE, "moe.router_enable_expert_bias", _switch("--moe-router-enable-expert-bias")),
    _field(MEANING, "rotary_percent", _valued("--rotary-percent"), when=_rope),
    _field(MEANING, "rotary_base", _valued("--rotary-base"), when=_rope),
    _field(MEANING, "norm_epsilon", _valued("--norm-epsilon")),
    Rule(
        MEANING,
        "router score function",
        ("moe.router_score_function",),
        lambda config: config.moe.score_function if config.is_moe else None,
        _valued("--moe-router-score-function"),
    ),
    # DeepSpeed's gating rules or Megatron-Core's routing with its softmax scores
    _field(FREE, "moe.router_score_function", _valued("--moe-router-score-function")),
    _field(FREE, "hidden_dropout", _valued("--hidden-dropout")),
    _field(FREE, "attention_dropout", _valued("--attention-dropout")),
    _field(FREE, "init_method_std", _valued("--init-method-std")),
    _field(FREE, "checkpoint_activations", _switch("--checkpoint-activations")),
    _field(FREE, "moe.topk", _valued("--moe-router-topk")),
    _field(FREE, "moe.train_capacity_factor", _valued("--moe-train-capacity-factor")),
    _field(FREE, "moe.eval_capacity_factor", _valued("--moe-eval-capacity-factor")),
    _field(FREE, "moe.min_capacity", _valued("--moe-min-capacity")),
    _field(FREE, "moe.drop_tokens", _switch("--disable-moe-token-dropping", when=False)),
    _field(FREE, "moe.use_rts", _switch("--disable-moe-rts", when=False)),
    _field(FREE, "moe.noisy_gate_policy", _valued("--moe-noisy-gate-policy")),
    _field(FREE, "moe.sample_second_expert", _switch("--disable-moe-top2-2nd-expert-sampling", when=False)),
    _field(FREE, "moe.aux_loss_coeff", _valued("--moe-loss-coeff")),
    _field(FREE, "moe.z_loss_coeff", _valued("--moe-z-loss-coeff")),
    _field(FREE, "moe.drop_policy", _valued("--moe-token-drop-policy")),
    _field(FREE, "moe.router_pre_softmax", _switch("--moe-router-pre-softmax")),
    _field(FREE, "moe.router_topk_scaling_factor", _valued("--moe-router-topk-scaling-factor")),
    _field(FREE, "moe.router_num_groups", _valued("--moe-router-num-groups")),
    _field(FREE, "moe.router_group_topk", _valued("--moe-router-group-topk")),
    _field(FREE, "moe.router_norm_topk_prob", _switch("--disable-moe-router-norm-topk-prob", when=False)),
    _field(FREE, "moe.router_bias_update_rate", _valued("--moe-router-bias-update-rate")),
    _field(FREE, "moe.router_load_balancing_type", _valued("--moe-router-load-balancing-type")),
)


def config_field_names() -> set[str]:
    """Every GPTConfig field, MoEConfig's as `moe.NAME`: each must be covered by a rule."""
    names = {field.name for field in fields(GPTConfig) if field.name != "moe"}
    return names | {f"moe.{field.name}" for field in fields(MoEConfig)}


def check_model_config(
    folder: Path, manifest: Manifest, run: GPTConfig, weights_only: bool, log: Callable[[str], None]
) -> None:
    """Refuse with one sentence where checkpoint `folder`'s model (its `manifest`'s) differs from
    `run` (the run's, with its padded vocabulary) in a SHAPE field, or in a MEANING one on a resume
    (`weights_only`: the run loads the weights only, as --reset-iteration does); log the changes allowed."""
    recorded = manifest.run
    if recorded is None:
        log(f" > {folder} records no model config: it is loaded without comparing the model with this run's")
        return
    saved = recorded.model
    changes: list[str] = []
    covered: set[str] = set()
    for rule in RULES:
        there, here = rule.value(saved), rule.value(run)
        if there == here or covered & set(rule.covers):
            continue
        if rule.tier == SHAPE or (rule.tier == MEANING and not weights_only):
            how = "resumed" if rule.tier == MEANING else "loaded"
            raise CheckpointError(
                f"the checkpoint {folder} was saved with {rule.label} {_shown(there)} but this run has "
                f"{_shown(here)}, so it cannot be {how} into this model; {rule.fix(there)} to load it"
                + (", or --reset-iteration to start a new run from its weights" if rule.tier == MEANING else "")
            )
        covered.update(rule.covers)
        changes.append(f"{rule.label} {_shown(there)} -> {_shown(here)}")
    if changes:
        log(
            f" > {folder}: this run changes {'; '.join(changes)} (allowed when loading; "
            "docs/checkpoints.md lists what may change)"
        )
