"""A typed model config and tokenizer spec back to pretrain_gpt.py's flags: the inverse of
flags.py's model_config_from_args and tokenizer_spec_of, for tools that build a config without
flags (the Hugging Face importer) and print the flags that continue training it. A test parses the
printed flags back and compares field by field, so every field of GPTConfig and MoEConfig is
covered here or named there as derived.

The shape (layers, widths, heads, positions, init, norm epsilon, dropouts) is always printed, and
an MoE model's expert layout, loss weight and top-k; every other flag only where the config differs
from the flag's default."""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megatron.model import GPTConfig
from megatron.tokenizer_spec import NULL_EOD_LAST, TokenizerSpec

Value = Callable[[GPTConfig], Any]


@dataclass(frozen=True)
class ModelFlag:
    name: str
    value: Value  # the config's value; a bool prints the bare flag when it differs from the default
    default: Any = None
    always: Callable[[GPTConfig], bool] = lambda config: False

    def argv(self, config: GPTConfig) -> list[str]:
        value = self.value(config)
        if not self.always(config) and value == self.default:
            return []
        if isinstance(value, bool):
            return [self.name]
        return [self.name, *map(_text, value if isinstance(value, tuple) else (value,))]


def _text(value: Any) -> str:
    return repr(float(value)) if isinstance(value, float) else str(value)


def _always(config: GPTConfig) -> bool:
    return True


def _moe(config: GPTConfig) -> bool:
    return config.is_moe


def _rope(config: GPTConfig) -> bool:
    return config.position_embedding_type == "rope"


def _field(name: str) -> Value:
    return lambda config: getattr(config, name)


def _moe_field(name: str) -> Value:
    return lambda config: getattr(config.moe, name)


def _expert_width(config: GPTConfig) -> int | None:
    """None where the flag's default, the dense width, holds."""
    width = config.moe_ffn_hidden_size
    return None if width == config.ffn_hidden_size else width


MODEL_FLAGS = (
    ModelFlag("--num-layers", _field("num_layers"), always=_always),
    ModelFlag("--hidden-size", _field("hidden_size"), always=_always),
    ModelFlag("--num-attention-heads", _field("num_attention_heads"), always=_always),
    ModelFlag("--ffn-hidden-size", _field("ffn_hidden_size"), always=_always),
    ModelFlag("--max-position-embeddings", _field("max_position_embeddings"), always=_always),
    ModelFlag("--init-method-std", _field("init_method_std"), always=_always),
    ModelFlag("--untie-embeddings-and-output-weights", _field("untie_embeddings_and_output_weights"), False),
    ModelFlag("--normalization", _field("normalization"), "LayerNorm"),
    ModelFlag("--norm-epsilon", _field("norm_epsilon"), always=_always),
    ModelFlag("--swiglu", _field("swiglu"), False),
    ModelFlag("--hidden-dropout", _field("hidden_dropout"), always=_always),
    ModelFlag("--attention-dropout", _field("attention_dropout"), always=_always),
    ModelFlag("--position-embedding-type", _field("position_embedding_type"), "learned_absolute"),
    ModelFlag("--rotary-base", _field("rotary_base"), 10000.0, always=_rope),
    ModelFlag("--rotary-percent", _field("rotary_percent"), 1.0),
    ModelFlag("--disable-bias-linear", _field("add_bias_linear"), True),
    ModelFlag("--group-query-attention", lambda config: config.num_query_groups is not None, False),
    ModelFlag("--num-query-groups", _field("num_query_groups")),
    ModelFlag("--kv-channels", _field("kv_channels")),
    ModelFlag("--qk-layernorm", _field("qk_layernorm"), False),
    ModelFlag("--checkpoint-activations", _field("checkpoint_activations"), False),
    ModelFlag("--num-experts", _field("num_experts"), (1,), always=_moe),
    ModelFlag("--expert-interval", _field("expert_interval"), 2, always=_moe),
    ModelFlag("--mlp-type", _field("mlp_type"), "standard"),
    ModelFlag("--disable-moe-token-dropping", _moe_field("drop_tokens"), True),
    ModelFlag("--moe-ffn-hidden-size", _expert_width),
    ModelFlag("--moe-loss-coeff", _moe_field("aux_loss_coeff"), 0.01, always=_moe),
    ModelFlag("--moe-z-loss-coeff", _moe_field("z_loss_coeff"), 0.0),
    ModelFlag("--moe-train-capacity-factor", _moe_field("train_capacity_factor"), 1.0),
    ModelFlag("--moe-eval-capacity-factor", _moe_field("eval_capacity_factor"), 1.0),
    ModelFlag("--moe-min-capacity", _moe_field("min_capacity"), 4),
    ModelFlag("--moe-noisy-gate-policy", _moe_field("noisy_gate_policy")),
    ModelFlag("--disable-moe-rts", _moe_field("use_rts"), True),
    ModelFlag("--moe-token-drop-policy", _moe_field("drop_policy"), "probs"),
    ModelFlag("--disable-moe-top2-2nd-expert-sampling", _moe_field("sample_second_expert"), True),
    ModelFlag("--moe-router-topk", _moe_field("topk"), 1, always=_moe),
    ModelFlag("--moe-router-score-function", _moe_field("router_score_function")),
    ModelFlag("--moe-router-pre-softmax", _moe_field("router_pre_softmax"), False),
    ModelFlag("--moe-router-enable-expert-bias", _moe_field("router_enable_expert_bias"), False),
    ModelFlag("--disable-moe-router-norm-topk-prob", _moe_field("router_norm_topk_prob"), True),
    ModelFlag("--moe-router-topk-scaling-factor", _moe_field("router_topk_scaling_factor")),
    ModelFlag("--moe-router-num-groups", _moe_field("router_num_groups")),
    ModelFlag("--moe-router-group-topk", _moe_field("router_group_topk")),
    ModelFlag("--moe-router-bias-update-rate", _moe_field("router_bias_update_rate"), 1e-3),
    ModelFlag("--moe-router-load-balancing-type", _moe_field("router_load_balancing_type"), "aux_loss"),
    ModelFlag("--moe-shared-expert-intermediate-size", _field("moe_shared_expert_intermediate_size")),
    ModelFlag("--moe-shared-expert-gate", _field("moe_shared_expert_gate"), False),
)


def model_flags(config: GPTConfig) -> list[str]:
    """pretrain_gpt.py's flags that build `config` (its vocabulary comes from the tokenizer flags)."""
    return [text for flag in MODEL_FLAGS for text in flag.argv(config)]


def tokenizer_flags(spec: TokenizerSpec) -> list[str]:
    """pretrain_gpt.py's flags for the tokenizer `spec` names."""
    argv = ["--tokenizer-type", spec.tokenizer_type]
    for name, value in (
        ("--tokenizer-model", spec.tokenizer_model),
        ("--vocab-file", spec.vocab_file),
        ("--merge-file", spec.merge_file),
        ("--vocab-size", spec.vocab_size),
    ):
        argv += [] if value is None else [name, str(value)]
    return argv + (
        [] if spec.null_tokenizer_eod == NULL_EOD_LAST else ["--null-tokenizer-eod", spec.null_tokenizer_eod]
    )
