"""Which Hugging Face class computes a model of ours exactly, and the config.json that says so
(config_import.py goes back again).

Each class is a `Spec` of what it can express (norm, MLP, biases, positions, attention, MoE
layout, routing). A model is exported as the one class whose spec it meets; a model that no class
computes exactly is refused with the first feature the closest class lacks, never exported
approximately.
"""

from dataclasses import dataclass
from typing import Any

from megatron.errors import CheckpointError
from megatron.hf.routing import Routing, routing_of, unsupported_routing
from megatron.model import GPTConfig


@dataclass(frozen=True)
class Spec:
    """What one Hugging Face class can express."""

    name: str  # as people say it
    model_type: str  # config.json's model_type
    hf_class: str  # config.json's architectures
    family: str  # tensor names: gpt2, gpt_neox or llama (tensor_maps.py)
    normalization: str = "RMSNorm"
    swiglu: bool = True
    biases: tuple[bool, ...] = (False,)  # the add_bias_linear values it can express
    positions: str = "rope"
    partial_rotary: bool = False
    gqa: bool = True  # fewer key/value heads than heads, and a head dim of its own
    qk_norm: tuple[bool, ...] = (False,)
    moe: bool = False
    dense_layers: str = "none"  # MoE models: "none", "any" (a list of dense layers) or "first" (the first k)
    shared: str = "none"  # MoE models: "none", "gated" (always, sigmoid-gated) or "ungated" (optional)
    score: str = "softmax"
    renormalises_only: bool = False  # top-k gates always divided by their sum (Mixtral)


GPT2 = Spec(
    "GPT-2",
    "gpt2",
    "GPT2LMHeadModel",
    "gpt2",
    normalization="LayerNorm",
    swiglu=False,
    biases=(True,),
    positions="learned_absolute",
    gqa=False,
)
GPT_NEOX = Spec(
    "GPT-NeoX",
    "gpt_neox",
    "GPTNeoXForCausalLM",
    "gpt_neox",
    normalization="LayerNorm",
    swiglu=False,
    biases=(True,),
    partial_rotary=True,
    gqa=False,
)
LLAMA = Spec("Llama", "llama", "LlamaForCausalLM", "llama", biases=(False, True))
QWEN3 = Spec("Qwen3", "qwen3", "Qwen3ForCausalLM", "llama", qk_norm=(True,))
MIXTRAL = Spec("Mixtral", "mixtral", "MixtralForCausalLM", "llama", moe=True, renormalises_only=True)
QWEN3_MOE = Spec(
    "Qwen3-MoE", "qwen3_moe", "Qwen3MoeForCausalLM", "llama", qk_norm=(True,), moe=True, dense_layers="any"
)
QWEN2_MOE = Spec("Qwen2-MoE", "qwen2_moe", "Qwen2MoeForCausalLM", "llama", moe=True, dense_layers="any", shared="gated")
GLM4_MOE = Spec(
    "GLM-4-MoE",
    "glm4_moe",
    "Glm4MoeForCausalLM",
    "llama",
    partial_rotary=True,
    qk_norm=(False, True),
    moe=True,
    dense_layers="first",
    shared="ungated",
    score="sigmoid",
)
DENSE_SPECS = (GPT2, GPT_NEOX, LLAMA, QWEN3)
MOE_SPECS = (MIXTRAL, QWEN3_MOE, QWEN2_MOE, GLM4_MOE)
BY_MODEL_TYPE = {spec.model_type: spec for spec in DENSE_SPECS + MOE_SPECS}

_POSITIONS = {
    "learned_absolute": "learned absolute position embeddings",
    "rope": "rotary embeddings",
    "none": "lack of position embeddings",
}


def _attention_mismatches(spec: Spec, c: GPTConfig) -> list[str]:
    found = []
    if c.position_embedding_type != spec.positions:
        found.append(f"{_POSITIONS[c.position_embedding_type]} ({spec.name} has {_POSITIONS[spec.positions]})")
    elif c.position_embedding_type == "rope" and c.rotary_percent != 1.0 and not spec.partial_rotary:
        found.append(f"rotary embeddings over {c.rotary_percent:g} of each head ({spec.name} rotates all of it)")
    if not spec.gqa and c.kv_heads != c.num_attention_heads:
        found.append(f"grouped-query attention ({spec.name} has one key/value head per head)")
    if not spec.gqa and c.head_dim * c.num_attention_heads != c.hidden_size:
        found.append(f"a head dim of its own, --kv-channels ({spec.name}'s is hidden size / heads)")
    if c.qk_layernorm not in spec.qk_norm:
        found.append(
            f"query/key norms ({spec.name} has none)"
            if c.qk_layernorm
            else f"attention without query/key norms ({spec.name} always has them)"
        )
    return found


def _block_mismatches(spec: Spec, c: GPTConfig) -> list[str]:
    found = []
    if c.normalization != spec.normalization:
        found.append(f"{c.normalization} ({spec.name} normalises with {spec.normalization})")
    if c.swiglu != spec.swiglu:
        found.append(f"SwiGLU MLPs ({spec.name}'s are GELU)" if c.swiglu else f"GELU MLPs ({spec.name}'s are SwiGLU)")
    if c.add_bias_linear not in spec.biases:
        found.append(
            f"biases in its linear layers ({spec.name} has none)"
            if c.add_bias_linear
            else f"linear layers without biases ({spec.name}'s have them)"
        )
    return found + _attention_mismatches(spec, c)


def _layout_mismatches(spec: Spec, c: GPTConfig) -> list[str]:
    """Where the MoE layers are and what sits beside their experts."""
    found = []
    moe_layers = [count > 1 for count in c.experts_per_layer]
    first_moe = moe_layers.index(True)
    if spec.dense_layers == "none" and not all(moe_layers):
        found.append(f"dense layers among the MoE layers (every layer of {spec.name} is MoE)")
    if spec.dense_layers == "first" and not all(moe_layers[first_moe:]):
        found.append(f"dense layers after the first MoE layer ({spec.name}'s dense layers come first)")
    shared, gated = c.moe_shared_expert_intermediate_size, c.moe_shared_expert_gate
    if spec.shared == "none" and shared is not None:
        found.append(f"shared experts ({spec.name} has none)")
    if spec.shared == "gated" and not gated:
        found.append(
            f"{'ungated shared experts' if shared else 'no shared experts'} ({spec.name} always has "
            "sigmoid-gated shared experts)"
        )
    if spec.shared == "ungated" and gated:
        found.append(f"a sigmoid gate on the shared experts ({spec.name} has none)")
    if spec.shared == "ungated" and shared is not None and shared % c.moe_ffn_hidden_size:
        found.append(
            f"shared experts {shared} wide ({spec.name}'s are a multiple of the expert width {c.moe_ffn_hidden_size})"
        )
    return found


def _routing_mismatches(spec: Spec, routing: Routing) -> list[str]:
    if routing.score != spec.score:
        return [f"{routing.score} router scores ({spec.name} scores with a {spec.score})"]
    if spec.renormalises_only and not routing.normalized:
        return [f"top-{routing.topk} gates kept as scored ({spec.name} divides them by their sum)"]
    unsupported = unsupported_routing(routing)
    return [unsupported] if unsupported else []


def mismatches(spec: Spec, c: GPTConfig) -> list[str]:
    """What of model `c` the class of `spec` cannot compute, as phrases."""
    found = _block_mismatches(spec, c)
    if spec.moe != c.is_moe:
        return found + [f"MoE layers ({spec.name} is dense)" if c.is_moe else f"no MoE layers ({spec.name} has them)"]
    if spec.moe:
        found += _layout_mismatches(spec, c) + _routing_mismatches(spec, routing_of(c.moe))
    return found


def _refuse_outright(c: GPTConfig) -> str | None:
    """Features that no class has at all, named on their own."""
    if c.mlp_type == "residual":
        return (
            "PR-MoE's residual MLP mixed into the experts by learned per-token coefficients (--mlp-type residual) "
            "has no Hugging Face equivalent (shared experts, --moe-shared-expert-intermediate-size, have one)"
        )
    if len({count for count in c.experts_per_layer if count > 1}) > 1:
        return (
            f"MoE layers with different expert counts {c.experts_per_layer} (a pyramid) have no Hugging Face "
            "equivalent (its MoE classes give every MoE layer the same experts)"
        )
    return None


def choose_spec(c: GPTConfig, source: str) -> Spec:
    """The Hugging Face class that computes model `c` exactly; refuses (one sentence) when none does."""
    outright = _refuse_outright(c)
    if outright:
        raise CheckpointError(f"{source} was not exported: {outright}")
    candidates = MOE_SPECS if c.is_moe else DENSE_SPECS
    found = {spec: mismatches(spec, c) for spec in candidates}
    for spec, problems in found.items():
        if not problems:
            return spec
    # fewest mismatches; between equals, a class whose router scores as ours does
    score = routing_of(c.moe).score
    closest = min(candidates, key=lambda spec: (len(found[spec]), spec.moe and spec.score != score))
    raise CheckpointError(
        f"{source} was not exported: no Hugging Face class computes this model exactly, and the closest, "
        f"{closest.name}, has no equivalent of its {found[closest][0]}; export only models a class computes "
        "(README: Hugging Face export and import)"
    )


# ---- config.json ---------------------------------------------------------------------------------


def _rope(c: GPTConfig, partial: bool) -> dict[str, Any]:
    """Rope as transformers 5 writes it; transformers 4 reads rope_theta (GPT-NeoX: rotary_emb_base)."""
    parameters = {"rope_type": "default", "rope_theta": c.rotary_base}
    if partial:
        parameters["partial_rotary_factor"] = c.rotary_percent
    return {"rope_parameters": parameters}


def _llama_like(c: GPTConfig, spec: Spec) -> dict[str, Any]:
    return {
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.ffn_hidden_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": c.max_position_embeddings,
        "initializer_range": c.init_method_std,
        "rms_norm_eps": c.norm_epsilon,
        "tie_word_embeddings": not c.untie_embeddings_and_output_weights,
        "attention_dropout": c.attention_dropout,
        **_rope(c, spec.partial_rotary),
        "rope_theta": c.rotary_base,
    }


def _dense_layers(c: GPTConfig) -> dict[str, Any]:
    """Qwen's layer layout: layer i (from 0) is MoE when (i + 1) % decoder_sparse_step == 0 and i is
    not in mlp_only_layers, which is ours with --expert-interval and per-layer counts of 1."""
    candidates = [i for i in range(c.num_layers) if (i + 1) % c.expert_interval == 0]
    return {
        "decoder_sparse_step": c.expert_interval,
        "mlp_only_layers": [i for i in candidates if c.experts_per_layer[i] == 1],
    }


def _moe_keys(c: GPTConfig, routing: Routing) -> dict[str, Any]:
    return {
        "num_experts_per_tok": routing.topk,
        "moe_intermediate_size": c.moe_ffn_hidden_size,
        "norm_topk_prob": routing.normalized,
        "output_router_logits": False,
    }


def _experts(c: GPTConfig) -> int:
    return max(c.experts_per_layer)


def hf_config(spec: Spec, c: GPTConfig, tokens: dict[str, int | None]) -> dict[str, Any]:
    """config.json for model `c` as class `spec`, with the tokenizer's special token ids."""
    bias, tied, routing = c.add_bias_linear, not c.untie_embeddings_and_output_weights, routing_of(c.moe)
    if spec is GPT2:
        inner = None if c.ffn_hidden_size == 4 * c.hidden_size else c.ffn_hidden_size  # as GPT-2's configs say it
        keys = {
            "vocab_size": c.vocab_size,
            "n_positions": c.max_position_embeddings,
            "n_embd": c.hidden_size,
            "n_layer": c.num_layers,
            "n_head": c.num_attention_heads,
            "n_inner": inner,
            "activation_function": "gelu",
            "resid_pdrop": c.hidden_dropout,
            "embd_pdrop": c.hidden_dropout,
            "attn_pdrop": c.attention_dropout,
            "layer_norm_epsilon": c.norm_epsilon,
            "initializer_range": c.init_method_std,
            "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False,
            "tie_word_embeddings": tied,
        }
    elif spec is GPT_NEOX:
        keys = {
            "vocab_size": c.vocab_size,
            "hidden_size": c.hidden_size,
            "num_hidden_layers": c.num_layers,
            "num_attention_heads": c.num_attention_heads,
            "intermediate_size": c.ffn_hidden_size,
            "hidden_act": "gelu",
            "hidden_dropout": c.hidden_dropout,
            "attention_dropout": c.attention_dropout,
            "max_position_embeddings": c.max_position_embeddings,
            "initializer_range": c.init_method_std,
            "layer_norm_eps": c.norm_epsilon,
            "use_parallel_residual": False,
            "attention_bias": True,
            "tie_word_embeddings": tied,
            **_rope(c, partial=True),
            "rotary_pct": c.rotary_percent,
            "rotary_emb_base": c.rotary_base,
        }
    elif spec is LLAMA:
        keys = {**_llama_like(c, spec), "attention_bias": bias, "mlp_bias": bias, "pretraining_tp": 1}
    elif spec is QWEN3:
        keys = {**_llama_like(c, spec), "attention_bias": False, "use_sliding_window": False, "sliding_window": None}
    elif spec is MIXTRAL:
        keys = {
            **_llama_like(c, spec),
            "intermediate_size": c.moe_ffn_hidden_size,
            "num_local_experts": _experts(c),
            "num_experts_per_tok": routing.topk,
            "sliding_window": None,
            "router_jitter_noise": 0.0,
            "router_aux_loss_coef": c.moe.aux_loss_coeff,
            "output_router_logits": False,
        }
    elif spec is QWEN3_MOE:
        keys = {
            **_llama_like(c, spec),
            **_moe_keys(c, routing),
            **_dense_layers(c),
            "num_experts": _experts(c),
            "attention_bias": False,
            "use_sliding_window": False,
            "sliding_window": None,
            "router_aux_loss_coef": c.moe.aux_loss_coeff,
        }
    elif spec is QWEN2_MOE:
        keys = {
            **_llama_like(c, spec),
            **_moe_keys(c, routing),
            **_dense_layers(c),
            "num_experts": _experts(c),
            "shared_expert_intermediate_size": c.moe_shared_expert_intermediate_size,
            "qkv_bias": False,
            "use_sliding_window": False,
            "router_aux_loss_coef": c.moe.aux_loss_coeff,
        }
    else:
        keys = {
            **_llama_like(c, spec),
            **_moe_keys(c, routing),
            "n_routed_experts": _experts(c),
            "n_shared_experts": (c.moe_shared_expert_intermediate_size or 0) // c.moe_ffn_hidden_size,
            "first_k_dense_replace": [count > 1 for count in c.experts_per_layer].index(True),
            "n_group": routing.num_groups,
            "topk_group": routing.group_topk,
            "routed_scaling_factor": routing.scaling,
            "use_qk_norm": c.qk_layernorm,
            "attention_bias": False,
            "partial_rotary_factor": c.rotary_percent,
            "num_nextn_predict_layers": 0,
        }
    return {"architectures": [spec.hf_class], "model_type": spec.model_type, **keys, **tokens, "use_cache": True}
