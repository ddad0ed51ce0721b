"""Pre-LN transformer block as Megatron builds it: norm -> causal self-attention -> residual,
norm -> MLP -> residual. The MLP is passed in, so a block can hold a dense MLP or an MoE layer.
Megatron-LM's model options shape the parts: LayerNorm or RMSNorm, GELU or SwiGLU, biases or
none, grouped-query attention, a head dim of its own, query/key norms, full or partial rope.

Under tensor parallelism (megatron/model/tensor_parallel.py) each linear is built whole, then
keeps its rank's slice: attention's heads (and key/value groups) and the MLP's ffn width are split,
the norms are whole on every rank. With sequence parallelism a block's input and output are this
rank's positions of the sequence, and the norms' gradients are summed over the group.

Shapes: B batch, S sequence, H hidden, N heads, G key/value heads (query groups under GQA, else
N), D head dim (N * D = H unless --kv-channels says otherwise), R rotary dims, F ffn hidden.
Under tensor parallelism N, G and F count this rank's share.
"""

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from megatron.errors import ConfigError
from megatron.model.config import GPTConfig
from megatron.model.kv_cache import LayerKVCache
from megatron.model.moe.layer import MoELayer, RoutingStats
from megatron.model.tensor_parallel import ColumnParallelLinear, RowParallelLinear, TensorParallel, sum_gradient_over


def init_normal_(weight: torch.Tensor, std: float) -> None:
    nn.init.normal_(weight, mean=0.0, std=std)


def init_linear_(linear: nn.Linear, std: float) -> None:
    init_normal_(linear.weight, std)
    if linear.bias is not None:
        nn.init.zeros_(linear.bias)


def output_layer_std(config: GPTConfig) -> float:
    """Megatron scales the init of projections that write into the residual stream by
    1/sqrt(2L), so the residual variance does not grow with depth."""
    return config.init_method_std / math.sqrt(2.0 * config.num_layers)


def build_norm(config: GPTConfig, size: int, tp: TensorParallel = TensorParallel()) -> nn.Module:
    """The --normalization of the last `size` dims (weight "weight", and "bias" for LayerNorm).
    Under sequence parallelism each rank normalises its own positions, so the gradients of the
    (whole) weights are summed over the tensor-parallel group."""
    norm = (nn.RMSNorm if config.normalization == "RMSNorm" else nn.LayerNorm)(size, eps=config.norm_epsilon)
    if tp.sequence_parallel:
        for param in norm.parameters():
            sum_gradient_over(param, tp.group)
    return norm


def split_heads_evenly(config: GPTConfig, tp: TensorParallel) -> None:
    """Tensor parallelism gives each rank whole heads and whole key/value groups."""
    for count, flag in ((config.num_attention_heads, "--num-attention-heads"), (config.kv_heads, "--num-query-groups")):
        if count % tp.size:
            raise ConfigError(
                f"{flag} {count} cannot be split over --tensor-model-parallel-size {tp.size}; "
                "choose a tensor-parallel size that divides the heads and the key/value groups"
            )


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (rotate-half form) of each head's first R dims, the rest passed
    through (GPT-NeoX's and Megatron's --rotary-percent); cos/sin tables cached per position."""

    def __init__(self, rotary_dims: int, base: float, max_positions: int) -> None:
        super().__init__()
        self.rotary_dims = rotary_dims
        inv_freq_R2 = 1.0 / (base ** (torch.arange(0, rotary_dims, 2, dtype=torch.float32) / rotary_dims))
        angles_SR2 = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq_R2)
        angles_SR = torch.cat([angles_SR2, angles_SR2], dim=-1)
        self.register_buffer("cos_SR", angles_SR.cos(), persistent=False)
        self.register_buffer("sin_SR", angles_SR.sin(), persistent=False)

    def forward(self, x_BNSD: torch.Tensor, position_ids_BS: torch.Tensor) -> torch.Tensor:
        if self.rotary_dims == x_BNSD.shape[-1]:
            return self._rotate(x_BNSD, position_ids_BS)
        x_BNSR, rest_BNSD = x_BNSD.split([self.rotary_dims, x_BNSD.shape[-1] - self.rotary_dims], dim=-1)
        return torch.cat([self._rotate(x_BNSR, position_ids_BS), rest_BNSD], dim=-1)

    def _rotate(self, x_BNSR: torch.Tensor, position_ids_BS: torch.Tensor) -> torch.Tensor:
        cos = self.cos_SR[position_ids_BS].unsqueeze(1).to(x_BNSR.dtype)
        sin = self.sin_SR[position_ids_BS].unsqueeze(1).to(x_BNSR.dtype)
        first, second = x_BNSR.chunk(2, dim=-1)
        rotated = torch.cat([-second, first], dim=-1)
        return x_BNSR * cos + rotated * sin


def causal_mask(seq: int, past: int, device: torch.device) -> torch.Tensor:
    """[S, past + S] boolean mask: new token i sees every cached token and new tokens up to i."""
    keys = torch.arange(past + seq, device=device)
    return keys[None, :] <= past + torch.arange(seq, device=device)[:, None]


class CausalSelfAttention(nn.Module):
    """query_key_value holds N query heads and G key and value heads. Without GQA its rows are
    all queries, all keys, all values ([3, N, D]); with GQA they follow Megatron-LM: per query
    group, its N/G query heads, then its key head, then its value head ([G, N/G + 2, D])."""

    def __init__(self, config: GPTConfig, tp: TensorParallel = TensorParallel()) -> None:
        super().__init__()
        split_heads_evenly(config, tp)
        self.num_heads, self.kv_heads = config.num_attention_heads // tp.size, config.kv_heads // tp.size
        self.head_dim = config.head_dim
        self.grouped_layout = config.num_query_groups is not None
        # heads that share keys use SDPA's GQA where this torch has it, else repeated key/value heads;
        # decided once here, since the probe runs an attention of its own
        shares_keys = self.kv_heads != self.num_heads
        self.sdpa_gqa = shares_keys and sdpa_takes_gqa()
        self.kv_repeats = self.num_heads // self.kv_heads if shares_keys and not self.sdpa_gqa else 1
        self.dropout_p = config.attention_dropout
        query_width, kv_width = config.num_attention_heads * self.head_dim, config.kv_heads * self.head_dim
        bias = config.add_bias_linear
        self.query_key_value = nn.Linear(config.hidden_size, query_width + 2 * kv_width, bias=bias)
        self.dense = nn.Linear(query_width, config.hidden_size, bias=bias)
        init_linear_(self.query_key_value, config.init_method_std)
        init_linear_(self.dense, output_layer_std(config))
        if tp.enabled:  # the grouped layout splits into whole groups as it is; [3, N, D] part by part
            parts = None if self.grouped_layout else [query_width, kv_width, kv_width]
            self.query_key_value = ColumnParallelLinear(
                self.query_key_value, tp.group, sequence_parallel=tp.sequence_parallel, partition_sizes=parts
            )
            self.dense = RowParallelLinear(self.dense, tp.group, sequence_parallel=tp.sequence_parallel)
        self.q_layernorm = build_norm(config, self.head_dim) if config.qk_layernorm else None
        self.k_layernorm = build_norm(config, self.head_dim) if config.qk_layernorm else None
        for norm in (self.q_layernorm, self.k_layernorm) if tp.enabled and config.qk_layernorm else ():
            for param in norm.parameters():  # each rank normalises its own heads with the whole weights
                sum_gradient_over(param, tp.group)
        self.rotary = (
            RotaryEmbedding(config.rotary_dims, config.rotary_base, config.max_position_embeddings)
            if config.position_embedding_type == "rope"
            else None
        )

    def _split_heads(self, qkv_BSX: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries [B, N, S, D], keys and values [B, G, S, D] from the fused projection."""
        batch, seq, _ = qkv_BSX.shape
        if not self.grouped_layout:
            qkv_BS3ND = qkv_BSX.view(batch, seq, 3, self.num_heads, self.head_dim)
            q_BNSD, k_BNSD, v_BNSD = qkv_BS3ND.permute(2, 0, 3, 1, 4).unbind(0)
            return q_BNSD, k_BNSD, v_BNSD
        per_group = self.num_heads // self.kv_heads
        qkv_BSGXD = qkv_BSX.view(batch, seq, self.kv_heads, per_group + 2, self.head_dim)
        q_BSGQD, k_BSG1D, v_BSG1D = qkv_BSGXD.split([per_group, 1, 1], dim=3)
        q_BNSD = q_BSGQD.reshape(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)
        return q_BNSD, k_BSG1D.squeeze(3).transpose(1, 2), v_BSG1D.squeeze(3).transpose(1, 2)

    def forward(
        self, x_BSH: torch.Tensor, position_ids_BS: torch.Tensor, kv_cache: LayerKVCache | None = None
    ) -> torch.Tensor:
        """With `kv_cache`, x holds only the new tokens: they attend to the cached ones and themselves."""
        qkv_BSX = self.query_key_value(x_BSH)  # the whole sequence, also under sequence parallelism
        batch, seq, _ = qkv_BSX.shape
        q_BNSD, k_BGSD, v_BGSD = self._split_heads(qkv_BSX)
        if self.q_layernorm is not None:
            q_BNSD, k_BGSD = self.q_layernorm(q_BNSD), self.k_layernorm(k_BGSD)
        if self.rotary is not None:
            q_BNSD = self.rotary(q_BNSD, position_ids_BS)
            k_BGSD = self.rotary(k_BGSD, position_ids_BS)
        past = 0 if kv_cache is None else kv_cache.length
        if kv_cache is not None:
            k_BGSD, v_BGSD = kv_cache.append(k_BGSD, v_BGSD)
        # SDPA's is_causal aligns the mask top-left, so queries after cached keys need an explicit one
        mask_SK = None if past == 0 or seq == 1 else causal_mask(seq, past, qkv_BSX.device)
        if self.kv_repeats > 1:
            k_BGSD = k_BGSD.repeat_interleave(self.kv_repeats, dim=1)
            v_BGSD = v_BGSD.repeat_interleave(self.kv_repeats, dim=1)
        out_BNSD = F.scaled_dot_product_attention(
            q_BNSD,
            k_BGSD,
            v_BGSD,
            attn_mask=mask_SK,
            is_causal=past == 0 and seq > 1,
            dropout_p=self.dropout_p if self.training else 0.0,
            **({"enable_gqa": True} if self.sdpa_gqa else {}),
        )
        return self.dense(out_BNSD.transpose(1, 2).reshape(batch, seq, self.num_heads * self.head_dim))


@functools.cache
def sdpa_takes_gqa() -> bool:
    """Whether scaled_dot_product_attention takes enable_gqa (torch >= 2.5); torch 2.4, which the
    package allows, gets the key/value heads repeated instead."""
    q_BNSD, k_BGSD = torch.zeros(1, 2, 1, 2), torch.zeros(1, 1, 1, 2)
    try:
        F.scaled_dot_product_attention(q_BNSD, k_BGSD, k_BGSD, enable_gqa=True)
    except TypeError:
        return False
    return True


def swiglu(x_BSF2: torch.Tensor) -> torch.Tensor:
    """Megatron-LM's bias_swiglu (its bias already added by the linear): silu(first half) * second half."""
    gate_BSF, up_BSF = torch.chunk(x_BSF2, 2, dim=-1)
    return F.silu(gate_BSF) * up_BSF


class MLP(nn.Module):
    """Dense MLP: H -> F -> H with GELU, or with --swiglu H -> 2F -> (SwiGLU) F -> H. Works on any leading shape."""

    def __init__(
        self, config: GPTConfig, ffn_hidden_size: int | None = None, tp: TensorParallel = TensorParallel()
    ) -> None:
        """`ffn_hidden_size` overrides the config's F (shared experts have a width of their own)."""
        super().__init__()
        ffn = ffn_hidden_size or config.ffn_hidden_size
        width = 2 * ffn if config.swiglu else ffn
        self.dense_h_to_4h = nn.Linear(config.hidden_size, width, bias=config.add_bias_linear)
        self.dense_4h_to_h = nn.Linear(ffn, config.hidden_size, bias=config.add_bias_linear)
        init_linear_(self.dense_h_to_4h, config.init_method_std)
        init_linear_(self.dense_4h_to_h, output_layer_std(config))
        if tp.enabled:  # SwiGLU's gate and up halves split each on its own
            self.dense_h_to_4h = ColumnParallelLinear(
                self.dense_h_to_4h,
                tp.group,
                sequence_parallel=tp.sequence_parallel,
                partition_sizes=[ffn, ffn] if config.swiglu else None,
            )
            self.dense_4h_to_h = RowParallelLinear(self.dense_4h_to_h, tp.group, sequence_parallel=tp.sequence_parallel)
        self.activation = swiglu if config.swiglu else F.gelu

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(self.activation(self.dense_h_to_4h(x_BSH)))


@dataclass
class BlockOutput:
    hidden_BSH: torch.Tensor
    router_loss: torch.Tensor  # the MoE layer's weighted router loss; 0 for a dense MLP
    routing: RoutingStats | None  # the MoE layer's statistics; None for a dense MLP


class TransformerBlock(nn.Module):
    def __init__(self, config: GPTConfig, mlp: MLP | MoELayer, tp: TensorParallel = TensorParallel()) -> None:
        super().__init__()
        self.input_layernorm = build_norm(config, config.hidden_size, tp)
        self.self_attention = CausalSelfAttention(config, tp)
        self.post_attention_layernorm = build_norm(config, config.hidden_size, tp)
        self.mlp = mlp
        self.routes_tokens = isinstance(mlp, MoELayer)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(
        self, x_BSH: torch.Tensor, position_ids_BS: torch.Tensor, kv_cache: LayerKVCache | None = None
    ) -> BlockOutput:
        x_BSH = x_BSH + self.dropout(self.self_attention(self.input_layernorm(x_BSH), position_ids_BS, kv_cache))
        h_BSH = self.post_attention_layernorm(x_BSH)
        if not self.routes_tokens:
            no_loss = x_BSH.new_zeros((), dtype=torch.float32)
            return BlockOutput(x_BSH + self.dropout(self.mlp(h_BSH)), no_loss, None)
        moe = self.mlp(h_BSH)
        return BlockOutput(x_BSH + self.dropout(moe.hidden_BSH), moe.router_loss, moe.routing)
