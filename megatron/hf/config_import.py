"""A Hugging Face config (as transformers' AutoConfig reads config.json) -> our model config, built
directly; what ours cannot compute the same is refused with the feature it lacks. The flags that
continue training it are printed from the config (config/model_flags.py), never the other way.
"""

from dataclasses import dataclass
from typing import Any

from megatron.errors import CheckpointError, ConfigError
from megatron.hf.architectures import (
    BY_MODEL_TYPE,
    DENSE_SPECS,
    GLM4_MOE,
    GPT2,
    GPT_NEOX,
    LLAMA,
    MIXTRAL,
    MOE_SPECS,
    QWEN2_MOE,
    Spec,
)
from megatron.hf.routing import Routing, dropless_moe, unsupported_routing
from megatron.model import GPTConfig
from megatron.model.moe import MoEConfig


def _refuse(hf_dir: str, spec: Spec, what: str) -> CheckpointError:
    return CheckpointError(
        f"{hf_dir} ({spec.name}) was not imported: this toolkit has no equivalent of its {what}, "
        "so the model would not compute the same; nothing was written"
    )


def rope_of(hf: Any) -> dict[str, Any]:
    """rope_parameters as transformers 5 has them, or as transformers 4's attributes say."""
    if getattr(hf, "rope_parameters", None):
        return dict(hf.rope_parameters)
    scaling = getattr(hf, "rope_scaling", None) or {}
    return {
        "rope_type": scaling.get("rope_type", scaling.get("type", "default")),
        "rope_theta": getattr(hf, "rope_theta", getattr(hf, "rotary_emb_base", 10000.0)),
        "partial_rotary_factor": getattr(hf, "partial_rotary_factor", getattr(hf, "rotary_pct", 1.0)),
    }


@dataclass(frozen=True)
class Shape:
    """The fields every class has, under their names there."""

    layers: int
    hidden: int
    heads: int
    ffn: int
    positions: int
    std: float
    tied: bool

    def fields(self) -> dict[str, Any]:
        return dict(
            num_layers=self.layers,
            hidden_size=self.hidden,
            num_attention_heads=self.heads,
            vocab_size=None,
            ffn_hidden_size=self.ffn,
            max_position_embeddings=self.positions,
            init_method_std=float(self.std),
            untie_embeddings_and_output_weights=not self.tied,
        )


def _rope(hf: Any, hf_dir: str, spec: Spec) -> dict[str, Any]:
    rope = rope_of(hf)
    if rope.get("rope_type", "default") != "default":
        raise _refuse(hf_dir, spec, f"rope scaling {rope['rope_type']!r}")
    partial = float(rope.get("partial_rotary_factor", 1.0)) if spec.partial_rotary else 1.0
    return dict(
        position_embedding_type="rope", rotary_base=float(rope.get("rope_theta", 10000.0)), rotary_percent=partial
    )


def _shape(hf: Any) -> Shape:
    return Shape(
        hf.num_hidden_layers,
        hf.hidden_size,
        hf.num_attention_heads,
        hf.intermediate_size,
        hf.max_position_embeddings,
        hf.initializer_range,
        hf.tie_word_embeddings,
    )


def _llama_fields(hf: Any, hf_dir: str, spec: Spec, biases: bool) -> dict[str, Any]:
    if hf.hidden_act != "silu":
        raise _refuse(hf_dir, spec, f"activation {hf.hidden_act!r} (its SwiGLU uses silu)")
    windowed = getattr(hf, "use_sliding_window", False) if spec is not MIXTRAL else hf.sliding_window is not None
    if windowed:
        raise _refuse(hf_dir, spec, "sliding-window attention")
    heads, kv_heads = hf.num_attention_heads, hf.num_key_value_heads or hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    return dict(
        _shape(hf).fields(),
        normalization="RMSNorm",
        norm_epsilon=float(hf.rms_norm_eps),
        swiglu=True,
        hidden_dropout=0.0,
        attention_dropout=float(hf.attention_dropout),
        **_rope(hf, hf_dir, spec),
        add_bias_linear=biases,
        num_query_groups=kv_heads if kv_heads != heads else None,
        kv_channels=head_dim if head_dim * heads != hf.hidden_size else None,
    )


@dataclass(frozen=True)
class MoELayout:
    """A Hugging Face MoE config's router and which layers are MoE, in our terms."""

    routing: Routing
    experts_per_layer: tuple[int, ...]  # 1: a dense layer
    interval: int  # our --expert-interval: only every interval-th layer may be MoE


def moe_layout(hf: Any, spec: Spec) -> MoELayout:
    layers = hf.num_hidden_layers
    if spec is MIXTRAL:
        return MoELayout(Routing(hf.num_experts_per_tok), (hf.num_local_experts,) * layers, 1)
    if spec is GLM4_MOE:
        groups = (hf.n_group, hf.topk_group) if hf.topk_group < hf.n_group else (1, 1)  # all groups: no limit
        routing = Routing(
            hf.num_experts_per_tok, "sigmoid", hf.norm_topk_prob, float(hf.routed_scaling_factor), True, *groups
        )
        first = min(hf.first_k_dense_replace, layers)
        return MoELayout(routing, (1,) * first + (hf.n_routed_experts,) * (layers - first), 1)
    step, dense = hf.decoder_sparse_step, set(hf.mlp_only_layers or [])
    pattern = tuple(1 if i in dense or (i + 1) % step else hf.num_experts for i in range(layers))
    return MoELayout(Routing(hf.num_experts_per_tok, normalized=hf.norm_topk_prob), pattern, step)


def _moe_fields(hf: Any, hf_dir: str, spec: Spec) -> dict[str, Any]:
    layout = moe_layout(hf, spec)
    unsupported = unsupported_routing(layout.routing)
    if unsupported:
        raise _refuse(hf_dir, spec, unsupported)
    experts = max(layout.experts_per_layer)
    candidates = layout.experts_per_layer[layout.interval - 1 :: layout.interval]
    coeff = getattr(hf, "router_aux_loss_coef", None)
    fields = dict(
        num_experts=(experts,) if set(candidates) == {experts} else tuple(candidates),
        expert_interval=layout.interval,
        moe_ffn_hidden_size=getattr(hf, "moe_intermediate_size", None),
        moe=dropless_moe(layout.routing, MoEConfig.aux_loss_coeff if coeff is None else float(coeff)),
    )
    if spec is QWEN2_MOE:
        if not hf.shared_expert_intermediate_size:
            raise _refuse(hf_dir, spec, "shared experts of width 0")
        fields.update(
            moe_shared_expert_intermediate_size=hf.shared_expert_intermediate_size, moe_shared_expert_gate=True
        )
    if spec is GLM4_MOE and hf.n_shared_experts:
        fields.update(moe_shared_expert_intermediate_size=hf.n_shared_experts * hf.moe_intermediate_size)
    return fields


def _gpt2_fields(hf: Any, hf_dir: str) -> dict[str, Any]:
    if hf.activation_function != "gelu":
        raise _refuse(hf_dir, GPT2, f"activation {hf.activation_function!r} (ours is the exact, erf GELU)")
    if hf.scale_attn_by_inverse_layer_idx or not hf.scale_attn_weights or hf.add_cross_attention:
        raise _refuse(hf_dir, GPT2, "attention scaling or cross-attention options")
    shape = Shape(
        hf.n_layer,
        hf.n_embd,
        hf.n_head,
        hf.n_inner or 4 * hf.n_embd,
        hf.n_positions,
        hf.initializer_range,
        hf.tie_word_embeddings,
    )
    return dict(
        shape.fields(),
        norm_epsilon=float(hf.layer_norm_epsilon),
        hidden_dropout=float(hf.resid_pdrop),
        attention_dropout=float(hf.attn_pdrop),
    )


def _gpt_neox_fields(hf: Any, hf_dir: str) -> dict[str, Any]:
    if hf.hidden_act != "gelu":
        raise _refuse(hf_dir, GPT_NEOX, f"activation {hf.hidden_act!r} (ours is the exact, erf GELU)")
    if hf.use_parallel_residual:
        raise _refuse(hf_dir, GPT_NEOX, "parallel residual (use_parallel_residual: attention and MLP side by side)")
    if not hf.attention_bias:
        raise _refuse(hf_dir, GPT_NEOX, "attention without biases beside MLPs with them")
    return dict(
        _shape(hf).fields(),
        norm_epsilon=float(hf.layer_norm_eps),
        hidden_dropout=float(hf.hidden_dropout),
        attention_dropout=float(hf.attention_dropout),
        **_rope(hf, hf_dir, GPT_NEOX),
    )


def _model_fields(hf: Any, hf_dir: str, spec: Spec) -> dict[str, Any]:
    if spec is GPT2:
        return _gpt2_fields(hf, hf_dir)
    if spec is GPT_NEOX:
        return _gpt_neox_fields(hf, hf_dir)
    if spec is LLAMA:
        if hf.attention_bias != hf.mlp_bias:
            raise _refuse(hf_dir, spec, "biases in the attention or the MLP alone (ours has both or neither)")
        return _llama_fields(hf, hf_dir, spec, biases=hf.attention_bias)
    if getattr(hf, "attention_bias", False) or getattr(hf, "qkv_bias", False):
        raise _refuse(hf_dir, spec, "attention biases without MLP biases")
    fields = _llama_fields(hf, hf_dir, spec, biases=False)
    fields["qk_layernorm"] = spec.qk_norm == (True,) or getattr(hf, "use_qk_norm", False)
    return dict(fields, **_moe_fields(hf, hf_dir, spec)) if spec.moe else fields


def config_from_hf(hf: Any, hf_dir: str) -> tuple[Spec, GPTConfig]:
    """The class of a transformers config object and our model config for it (vocab_size None: the
    tokenizer and the checkpoint's rows decide it); refuses what ours cannot compute."""
    spec = BY_MODEL_TYPE.get(hf.model_type)
    if spec is None:
        known = ", ".join(f"{s.model_type} ({s.name})" for s in DENSE_SPECS + MOE_SPECS)
        raise CheckpointError(
            f"{hf_dir} holds a {hf.model_type!r} model, which this toolkit does not convert; it converts {known}"
        )
    fields = _model_fields(hf, hf_dir, spec)
    try:
        return spec, GPTConfig(**fields)
    except ConfigError as error:
        raise CheckpointError(
            f"{hf_dir} was not imported: its config describes a model this toolkit refuses ({error})"
        ) from None
