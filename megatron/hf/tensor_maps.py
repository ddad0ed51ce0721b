"""Tensor names and layouts: each `Link` ties some tensors of ours to some of a Hugging Face
class, with the function each way. Links are pure torch ops (views, transposes, slices, cats), so
running them on meta tensors gives every output's shape before any data is read, and running them
on real tensors converts one link at a time.

Layouts (ours -> theirs). Our linears are nn.Linear ([out, in]) except the experts, which are
x @ w: w1 [H, W] (W = 2F for SwiGLU: the gate's F columns first, then the up projection's, as the
dense MLP's `dense_h_to_4h` rows), w2 [F, H]; they are stored one entry per expert, `name[g]`.
The fused query_key_value rows are [3, N, D] (all queries, keys, values) without GQA and
Megatron-LM's grouped [G, N/G + 2, D] with it; GPT-2 keeps [3, N, D] transposed (Conv1D, x @ w),
GPT-NeoX [N, 3, D], the Llama family separate q, k and v projections.

Legend: N heads, G key/value heads, D head dim, H hidden, F ffn hidden, E experts.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron.model import GPTConfig

Tensors = tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class Link:
    ours: tuple[str, ...]
    theirs: tuple[str, ...]
    to_hf: Callable[..., Tensors]
    from_hf: Callable[..., Tensors]


def same(ours: str, theirs: str) -> Link:
    return Link((ours,), (theirs,), lambda t: (t,), lambda t: (t,))


def transposed(ours: str, theirs: str) -> Link:
    """GPT-2's Conv1D and our experts hold x @ w, nn.Linear x @ w.T."""
    return Link((ours,), (theirs,), lambda t: (t.t(),), lambda t: (t.t(),))


def only_theirs(theirs: tuple[str, ...], shape: tuple[int, ...], dtype: torch.dtype) -> Link:
    """Tensors their class always has and ours lacks, where zeros compute what ours does (an
    expert bias that is not there, shared experts of width 0); importing drops them."""
    return Link((), theirs, lambda: tuple(torch.zeros(shape, dtype=dtype) for _ in theirs), lambda *_: ())


# ---- attention ----------------------------------------------------------------------------------


def split_qkv(fused: torch.Tensor, c: GPTConfig) -> Tensors:
    """Our fused rows (a weight [X, H] or a bias [X]) as q [N*D, ...], k and v [G*D, ...]."""
    n, g, d, rest = c.num_attention_heads, c.kv_heads, c.head_dim, fused.shape[1:]
    if c.num_query_groups is None:
        return tuple(fused.view(3, n * d, *rest).unbind(0))
    per_group = n // g
    grouped = fused.view(g, per_group + 2, d, *rest)
    return (
        grouped[:, :per_group].reshape(n * d, *rest),
        grouped[:, per_group].reshape(g * d, *rest),
        grouped[:, per_group + 1].reshape(g * d, *rest),
    )


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, c: GPTConfig) -> torch.Tensor:
    n, g, d, rest = c.num_attention_heads, c.kv_heads, c.head_dim, q.shape[1:]
    if c.num_query_groups is None:
        return torch.cat([q, k, v])
    per_group = n // g
    return torch.cat([q.view(g, per_group, d, *rest), k.view(g, 1, d, *rest), v.view(g, 1, d, *rest)], dim=1).reshape(
        -1, *rest
    )


def neox_from_parts(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, c: GPTConfig) -> torch.Tensor:
    """GPT-NeoX fuses each head's query, key and value: [N, 3, D]."""
    n, d, rest = c.num_attention_heads, c.head_dim, q.shape[1:]
    return torch.stack([t.view(n, d, *rest) for t in (q, k, v)], dim=1).reshape(-1, *rest)


def neox_parts(fused: torch.Tensor, c: GPTConfig) -> Tensors:
    n, d, rest = c.num_attention_heads, c.head_dim, fused.shape[1:]
    return tuple(t.reshape(n * d, *rest) for t in fused.view(n, 3, d, *rest).unbind(1))


def attention_links(c: GPTConfig, family: str, ours: str, theirs: str) -> list[Link]:
    """query_key_value and dense of layer prefix `ours`, as `family` names them under `theirs`."""
    suffixes = ("weight", "bias") if c.add_bias_linear else ("weight",)
    links = []
    for suffix in suffixes:
        qkv = f"{ours}self_attention.query_key_value.{suffix}"
        dense = f"{ours}self_attention.dense.{suffix}"
        if family == "gpt2":
            flip = (lambda t: t.t()) if suffix == "weight" else (lambda t: t)
            links += [
                Link(
                    (qkv,),
                    (f"{theirs}attn.c_attn.{suffix}",),
                    lambda t, flip=flip: (flip(torch.cat(split_qkv(t, c))),),
                    lambda t, flip=flip: (fuse_qkv(*flip(t).split([c.hidden_size] * 3), c),),
                ),
                (transposed if suffix == "weight" else same)(dense, f"{theirs}attn.c_proj.{suffix}"),
            ]
        elif family == "gpt_neox":
            links += [
                Link(
                    (qkv,),
                    (f"{theirs}attention.query_key_value.{suffix}",),
                    lambda t: (neox_from_parts(*split_qkv(t, c), c),),
                    lambda t: (fuse_qkv(*neox_parts(t, c), c),),
                ),
                same(dense, f"{theirs}attention.dense.{suffix}"),
            ]
        else:
            names = tuple(f"{theirs}self_attn.{p}_proj.{suffix}" for p in "qkv")
            links += [
                Link((qkv,), names, lambda t: split_qkv(t, c), lambda q, k, v: (fuse_qkv(q, k, v, c),)),
                same(dense, f"{theirs}self_attn.o_proj.{suffix}"),
            ]
    if c.qk_layernorm:  # the Llama family only (Qwen3, Qwen3-MoE, GLM-4-MoE), RMSNorm: weights alone
        links += [
            same(f"{ours}self_attention.{p}_layernorm.weight", f"{theirs}self_attn.{p}_norm.weight") for p in "qk"
        ]
    return links


# ---- MLPs and experts -----------------------------------------------------------------------------


def gated_links(
    ours: str, theirs: str, bias: bool, up: str = "up_proj", gate: str = "gate_proj", down: str = "down_proj"
) -> list[Link]:
    """A SwiGLU MLP of ours (`ours` + dense_h_to_4h rows: gate then up; dense_4h_to_h) as separate
    gate, up and down projections."""
    links = []
    for suffix in ("weight", "bias") if bias else ("weight",):
        links += [
            Link(
                (f"{ours}dense_h_to_4h.{suffix}",),
                (f"{theirs}{gate}.{suffix}", f"{theirs}{up}.{suffix}"),
                lambda t: tuple(t.chunk(2)),
                lambda g, u: (torch.cat([g, u]),),
            ),
            same(f"{ours}dense_4h_to_h.{suffix}", f"{theirs}{down}.{suffix}"),
        ]
    return links


def expert_links(ours: str, theirs: str, experts: int, names: tuple[str, str, str]) -> list[Link]:
    """SwiGLU experts `ours`w1[g] / w2[g] as one module per expert, `theirs`{g}.{gate, up, down}.weight."""
    gate, up, down = names
    links = []
    for g in range(experts):
        prefix = f"{theirs}{g}."
        links += [
            Link(
                (f"{ours}w1[{g}]",),
                (f"{prefix}{gate}.weight", f"{prefix}{up}.weight"),
                lambda w1: tuple(half.t() for half in w1.chunk(2, dim=1)),
                lambda g_, u: (torch.cat([g_, u]).t(),),
            ),
            transposed(f"{ours}w2[{g}]", f"{prefix}{down}.weight"),
        ]
    return links


def moe_links(c: GPTConfig, model_type: str, ours: str, theirs: str, experts: int, dtype: torch.dtype) -> list[Link]:
    """The MoE block of layer prefixes `ours` (ours: mlp.) and `theirs` (model.layers.i.)."""
    router, ours_experts = f"{ours}mlp.router.", f"{ours}mlp.experts."
    if model_type == "mixtral":
        block = f"{theirs}block_sparse_moe."
        return [
            same(f"{router}weight", f"{block}gate.weight"),
            *expert_links(ours_experts, f"{block}experts.", experts, ("w1", "w3", "w2")),
        ]
    block = f"{theirs}mlp."
    links = [
        same(f"{router}weight", f"{block}gate.weight"),
        *expert_links(ours_experts, f"{block}experts.", experts, ("gate_proj", "up_proj", "down_proj")),
    ]
    shared = f"{ours}mlp.shared_expert."
    if model_type == "qwen2_moe":
        links += [
            *gated_links(f"{shared}mlp.", f"{block}shared_expert.", bias=False),
            same(f"{shared}gate.weight", f"{block}shared_expert_gate.weight"),
        ]
    if model_type == "glm4_moe":
        bias = f"{block}gate.e_score_correction_bias"
        links.append(
            same(f"{router}expert_bias", bias)
            if c.moe.router_enable_expert_bias
            else only_theirs((bias,), (experts,), torch.float32)
        )
        names = tuple(f"{block}shared_experts.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj"))
        if c.moe_shared_expert_intermediate_size is not None:
            links += gated_links(f"{shared}mlp.", f"{block}shared_experts.", bias=False)
        else:  # GLM-4-MoE always has shared experts: n_shared_experts 0 makes them 0 wide
            h = c.hidden_size
            links += [only_theirs(names[:2], (0, h), dtype), only_theirs(names[2:], (h, 0), dtype)]
    return links


# ---- whole models ---------------------------------------------------------------------------------


def model_links(c: GPTConfig, family: str, model_type: str, dtype: torch.dtype) -> list[Link]:
    """Every tensor of model `c` as class `model_type` (of tensor-name `family`) holds it; `dtype`
    for the zeros of tensors only theirs has."""
    bias = c.add_bias_linear
    norm_suffixes = ("weight", "bias") if c.normalization == "LayerNorm" else ("weight",)
    top = {"gpt2": "transformer.", "gpt_neox": "gpt_neox.", "llama": "model."}[family]
    embed = {"gpt2": "wte", "gpt_neox": "embed_in", "llama": "embed_tokens"}[family]
    final = {"gpt2": "ln_f", "gpt_neox": "final_layer_norm", "llama": "norm"}[family]
    head = "embed_out.weight" if family == "gpt_neox" else "lm_head.weight"  # as transformers saves each
    links = [same("word_embeddings.weight", f"{top}{embed}.weight")]
    if c.position_embedding_type == "learned_absolute":
        links.append(same("position_embeddings.weight", f"{top}wpe.weight"))
    for index, experts in enumerate(c.experts_per_layer):
        ours = f"layers.{index}."
        theirs = f"{top}h.{index}." if family == "gpt2" else f"{top}layers.{index}."
        norms = ("ln_1", "ln_2") if family == "gpt2" else ("input_layernorm", "post_attention_layernorm")
        for our_norm, their_norm in zip(("input_layernorm", "post_attention_layernorm"), norms):
            links += [same(f"{ours}{our_norm}.{s}", f"{theirs}{their_norm}.{s}") for s in norm_suffixes]
        links += attention_links(c, family, ours, theirs)
        if experts > 1:
            links += moe_links(c, model_type, ours, theirs, experts, dtype)
        elif family == "gpt2":
            links += [
                transposed(f"{ours}mlp.dense_h_to_4h.weight", f"{theirs}mlp.c_fc.weight"),
                transposed(f"{ours}mlp.dense_4h_to_h.weight", f"{theirs}mlp.c_proj.weight"),
            ]
            links += [
                same(f"{ours}mlp.dense_h_to_4h.bias", f"{theirs}mlp.c_fc.bias"),
                same(f"{ours}mlp.dense_4h_to_h.bias", f"{theirs}mlp.c_proj.bias"),
            ]
        elif family == "gpt_neox":
            links += [
                same(f"{ours}mlp.{p}.{s}", f"{theirs}mlp.{p}.{s}")
                for p in ("dense_h_to_4h", "dense_4h_to_h")
                for s in ("weight", "bias")
            ]
        else:
            links += gated_links(f"{ours}mlp.", f"{theirs}mlp.", bias)
    links += [same(f"final_layernorm.{s}", f"{top}{final}.{s}") for s in norm_suffixes]
    if c.untie_embeddings_and_output_weights:
        links.append(same("output_layer.weight", head))
    return links
