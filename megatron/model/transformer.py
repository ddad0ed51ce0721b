"""Pre-LN transformer block as Megatron builds it: LN -> causal self-attention -> residual,
LN -> MLP -> residual. The MLP is passed in, so a block can hold a dense MLP or an MoE layer.

Shapes: B batch, S sequence, H hidden, N heads, D head dim (H = N * D), F ffn hidden.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from megatron.model.config import GPTConfig
from megatron.model.kv_cache import LayerKVCache


def init_normal_(weight: torch.Tensor, std: float) -> None:
    nn.init.normal_(weight, mean=0.0, std=std)


def output_layer_std(config: GPTConfig) -> float:
    """Megatron scales the init of projections that write into the residual stream by
    1/sqrt(2L), so the residual variance does not grow with depth."""
    return config.init_method_std / math.sqrt(2.0 * config.num_layers)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (rotate-half form), cos/sin tables cached per length."""

    def __init__(self, head_dim: int, base: float, max_positions: int) -> None:
        super().__init__()
        inv_freq_D2 = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        angles_SD2 = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq_D2)
        angles_SD = torch.cat([angles_SD2, angles_SD2], dim=-1)
        self.register_buffer("cos_SD", angles_SD.cos(), persistent=False)
        self.register_buffer("sin_SD", angles_SD.sin(), persistent=False)

    def forward(self, x_BNSD: torch.Tensor, position_ids_BS: torch.Tensor) -> torch.Tensor:
        cos = self.cos_SD[position_ids_BS].unsqueeze(1).to(x_BNSD.dtype)
        sin = self.sin_SD[position_ids_BS].unsqueeze(1).to(x_BNSD.dtype)
        first, second = x_BNSD.chunk(2, dim=-1)
        rotated = torch.cat([-second, first], dim=-1)
        return x_BNSD * cos + rotated * sin


def causal_mask(seq: int, past: int, device: torch.device) -> torch.Tensor:
    """[S, past + S] boolean mask: new token i sees every cached token and new tokens up to i."""
    keys = torch.arange(past + seq, device=device)
    return keys[None, :] <= past + torch.arange(seq, device=device)[:, None]


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.dropout_p = config.attention_dropout
        self.query_key_value = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        init_normal_(self.query_key_value.weight, config.init_method_std)
        init_normal_(self.dense.weight, output_layer_std(config))
        nn.init.zeros_(self.query_key_value.bias)
        nn.init.zeros_(self.dense.bias)
        self.rotary = (
            RotaryEmbedding(config.head_dim, config.rotary_base, config.max_position_embeddings)
            if config.position_embedding_type == "rope"
            else None
        )

    def forward(
        self, x_BSH: torch.Tensor, position_ids_BS: torch.Tensor, kv_cache: LayerKVCache | None = None
    ) -> torch.Tensor:
        """With `kv_cache`, x holds only the new tokens: they attend to the cached ones and themselves."""
        batch, seq, hidden = x_BSH.shape
        qkv_BS3ND = self.query_key_value(x_BSH).view(batch, seq, 3, self.num_heads, self.head_dim)
        q_BNSD, k_BNSD, v_BNSD = qkv_BS3ND.permute(2, 0, 3, 1, 4).unbind(0)
        if self.rotary is not None:
            q_BNSD = self.rotary(q_BNSD, position_ids_BS)
            k_BNSD = self.rotary(k_BNSD, position_ids_BS)
        past = 0 if kv_cache is None else kv_cache.length
        if kv_cache is not None:
            k_BNSD, v_BNSD = kv_cache.append(k_BNSD, v_BNSD)
        # SDPA's is_causal aligns the mask top-left, so queries after cached keys need an explicit one
        mask_SK = None if past == 0 or seq == 1 else causal_mask(seq, past, x_BSH.device)
        out_BNSD = F.scaled_dot_product_attention(
            q_BNSD, k_BNSD, v_BNSD, attn_mask=mask_SK, is_causal=past == 0 and seq > 1,
            dropout_p=self.dropout_p if self.training else 0.0,
        )
        return self.dense(out_BNSD.transpose(1, 2).reshape(batch, seq, hidden))


class MLP(nn.Module):
    """Dense GELU MLP: H -> F -> H. Works on any leading shape."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.dense_h_to_4h = nn.Linear(config.hidden_size, config.ffn_hidden_size)
        self.dense_4h_to_h = nn.Linear(config.ffn_hidden_size, config.hidden_size)
        init_normal_(self.dense_h_to_4h.weight, config.init_method_std)
        init_normal_(self.dense_4h_to_h.weight, output_layer_std(config))
        nn.init.zeros_(self.dense_h_to_4h.bias)
        nn.init.zeros_(self.dense_4h_to_h.bias)

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(x_BSH)))


class TransformerBlock(nn.Module):
    def __init__(self, config: GPTConfig, mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)
        self.self_attention = CausalSelfAttention(config)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)
        self.mlp = mlp
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(
        self, x_BSH: torch.Tensor, position_ids_BS: torch.Tensor, kv_cache: LayerKVCache | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns the block's output and its MoE router loss (zero for a dense MLP)."""
        x_BSH = x_BSH + self.dropout(self.self_attention(self.input_layernorm(x_BSH), position_ids_BS, kv_cache))
        mlp_out = self.mlp(self.post_attention_layernorm(x_BSH))
        mlp_out, router_loss = mlp_out if isinstance(mlp_out, tuple) else (mlp_out, x_BSH.new_zeros((), dtype=torch.float32))
        return x_BSH + self.dropout(mlp_out), router_loss
