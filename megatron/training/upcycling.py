"""Upcycling (--moe-use-upcycling): an MoE model's first weights from a dense checkpoint, as
Megatron-Core's upcycling builds them (arXiv 2410.07524).

Every tensor the two models share by name and shape is copied (embeddings, attention, norms, the
dense layers' MLPs). In an MoE layer, each expert is a copy of that layer's dense MLP, or with
fine-grained experts (--moe-ffn-hidden-size f dividing the dense width F, granularity g = F / f)
one of its g column slices, expert e taking slice e mod g: SwiGLU's gate and up halves are sliced
alike. The router keeps its own initialisation, its first E/g rows each repeated g times, so the
g slices of one copy always score alike and are chosen together. A PR-MoE residual MLP is the
dense MLP itself.

Scaling, so that the upcycled model computes what the dense one does: with gates that sum to the
same c for every token over its k chosen experts (normalised top-k: DeepSpeed's top-2 and top-k,
Megatron-Core's softmax, normalised sigmoid; c is the top-k scaling factor, else 1; k a multiple
of g), the g slices of a copy share its gate equally, and their second weights are multiplied by
g / c: the output is then exactly the dense MLP's, whatever the activation (each slice's second
bias is the dense one times 1 / c). Where the gates' sum varies (DeepSpeed's top-1 and
pre-softmax keep the router probabilities, unnormalised sigmoid its scores), Megatron-Core's
factor E * g / k is used instead, which restores the dense output on average over near-uniform
router probabilities, not exactly. Megatron-Core scales both weights by a root of the factor;
scaling the second alone is exact for every activation.

Legend: E experts in the layer, H hidden, F dense ffn width, f expert width, g = F / f.
"""

from collections.abc import Callable

import torch

from megatron.checkpoint.reader import saved_run
from megatron.checkpoint.tensors import ShardedReader
from megatron.errors import ConfigError
from megatron.model import GPTConfig, GPTModel
from megatron.model.moe import MoELayer
from megatron.parallel import ParallelGrid
from megatron.placement import expert_ids, local_part

# what must match between the dense checkpoint and the MoE model for weights to carry over
ARCHITECTURE_FIELDS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "vocab_size",
    "ffn_hidden_size",
    "normalization",
    "norm_epsilon",
    "swiglu",
    "add_bias_linear",
    "untie_embeddings_and_output_weights",
    "num_query_groups",
    "kv_channels",
    "qk_layernorm",
    "position_embedding_type",
    "rotary_percent",
    "rotary_base",
)


def check_upcycling(moe: GPTConfig, dense: GPTConfig, source: str) -> None:
    """Stop with one sentence where the dense checkpoint `source` cannot become `moe`."""
    if dense.is_moe:
        raise ConfigError(
            f"--moe-use-upcycling builds an MoE model from a dense checkpoint, but {source} already has "
            "MoE layers; drop --moe-use-upcycling to load it as it is"
        )
    if not moe.is_moe:
        raise ConfigError("--moe-use-upcycling builds an MoE model, but the flags give none; add --num-experts N")
    learned_positions = ("max_position_embeddings",) if dense.position_embedding_type == "learned_absolute" else ()
    differing = moe.differences(dense, ARCHITECTURE_FIELDS + learned_positions)
    if differing:
        raise ConfigError(
            f"the dense checkpoint {source} differs from the flags outside the MoE layers "
            f"({'; '.join(differing)}); give the dense model's own model flags"
        )
    if moe.moe_shared_expert_intermediate_size is not None:
        raise ConfigError(
            "--moe-use-upcycling cannot start shared experts from a dense MLP and keep the dense model's "
            "output; drop --moe-shared-expert-intermediate-size or upcycle without it"
        )
    granularity, remainder = divmod(dense.ffn_hidden_size, moe.moe_ffn_hidden_size)
    if remainder:
        raise ConfigError(
            f"--moe-ffn-hidden-size {moe.moe_ffn_hidden_size} does not divide the dense checkpoint's "
            f"ffn width {dense.ffn_hidden_size}; give a width that divides it for --moe-use-upcycling"
        )
    uneven = [count for count in moe.experts_per_layer if count > 1 and count % granularity]
    if uneven:
        raise ConfigError(
            f"{uneven[0]} experts are not a multiple of the {granularity} slices each dense MLP splits "
            f"into; give --num-experts in multiples of {granularity} for --moe-use-upcycling"
        )
    if granularity > 1 and moe.moe.topk % granularity:
        raise ConfigError(
            f"--moe-router-topk {moe.moe.topk} does not choose whole copies of the dense MLP split into "
            f"{granularity} slices; give a multiple of {granularity} for --moe-use-upcycling"
        )


def upcycle_from_checkpoint(model: GPTModel, load_dir: str, grid: ParallelGrid, iteration: int | None) -> str:
    """Fill `model` from the dense checkpoint in `load_dir` (its latest, or `iteration`), after
    checking that it fits; returns the log line."""
    saved = saved_run(load_dir, grid, iteration)
    folder, dense = saved.folder, saved.run.model
    check_upcycling(model.config, dense, str(folder))
    return upcycle(model, ShardedReader(folder, "model").get, dense) + f" ({folder})"


def upcycle(model: GPTModel, dense_tensor: Callable[[str], torch.Tensor], dense: GPTConfig) -> str:
    """Fill `model` (MoE, this rank's experts) from the dense model's tensors, read by name through
    `dense_tensor`; returns the log line."""
    granularity = dense.ffn_hidden_size // model.config.moe_ffn_hidden_size
    moe_layers = {
        f"layers.{i}.mlp.": layer.mlp for i, layer in enumerate(model.layers) if isinstance(layer.mlp, MoELayer)
    }
    with torch.no_grad():
        for prefix, moe in moe_layers.items():
            _upcycle_layer(moe, prefix, dense_tensor, granularity, model.config.swiglu)
        for name, tensor in model.state_dict(keep_vars=True).items():
            if not any(name.startswith(prefix) for prefix in moe_layers):
                tensor.copy_(local_part(tensor, dense_tensor(name)))
    experts = "its layer's dense MLP" if granularity == 1 else f"one of {granularity} slices of its layer's dense MLP"
    scales = sorted({activation_scale(moe, granularity) for moe in moe_layers.values()})
    return f" > upcycled: each expert is {experts}, second weights scaled by {', '.join(f'{s:g}' for s in scales)}"


def activation_scale(moe: MoELayer, granularity: int) -> float:
    """What the experts' second weights are multiplied by (see the module docstring)."""
    gate_sum = moe.config.gate_sum
    if gate_sum is not None:
        return granularity / gate_sum
    return moe.num_experts * granularity / moe.config.topk


def _upcycle_layer(
    moe: MoELayer,
    prefix: str,
    dense_tensor: Callable[[str], torch.Tensor],
    granularity: int,
    swiglu: bool,
) -> None:
    experts = moe.experts
    scale = activation_scale(moe, granularity)
    w_in_WH = dense_tensor(prefix + "dense_h_to_4h.weight")
    w_out_HF = dense_tensor(prefix + "dense_4h_to_h.weight")
    f = w_out_HF.shape[1] // granularity
    bias = experts.b1 is not None
    b_in_W = dense_tensor(prefix + "dense_h_to_4h.bias") if bias else None
    b_out_H = dense_tensor(prefix + "dense_4h_to_h.bias") if bias else None
    whole: dict[str, list[torch.Tensor]] = {"w1": [], "w2": [], "b1": [], "b2": []}
    for global_id in expert_ids(experts.w1):
        own = torch.arange(global_id % granularity * f, (global_id % granularity + 1) * f)
        # SwiGLU's first weight holds the gate rows, then the up rows: both halves are sliced alike
        rows = torch.cat([own, own + w_out_HF.shape[1]]) if swiglu else own
        whole["w1"].append(w_in_WH[rows].t())
        whole["w2"].append(w_out_HF[:, own].t() * scale)
        if bias:
            whole["b1"].append(b_in_W[rows])
            whole["b2"].append(b_out_H * (scale / granularity))  # the g slices of a copy each add it
    for name, tensors in whole.items():
        if tensors:  # each expert whole, then this rank's slice under expert tensor parallelism
            param = getattr(experts, name)
            param.copy_(local_part(param, torch.stack(tensors)))
    router_EH = moe.router.weight
    router_EH.copy_(router_EH[: moe.num_experts // granularity].repeat_interleave(granularity, dim=0))
    if moe.residual_mlp is not None:
        for name, tensor in moe.residual_mlp.state_dict(keep_vars=True).items():
            tensor.copy_(dense_tensor(prefix + name))
