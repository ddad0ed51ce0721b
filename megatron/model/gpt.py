"""GPT language model: token (+ learned position) embeddings -> pre-LN blocks -> final LN ->
LM head tied to the token embedding. Returns logits, or per-token losses when labels are given.
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from megatron.model.config import GPTConfig
from megatron.model.transformer import MLP, TransformerBlock, init_normal_


class GPTModel(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if config.vocab_size is None:
            raise ValueError("GPTConfig.vocab_size must be set (the padded tokenizer vocabulary) before building the model")
        self.config = config
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        init_normal_(self.word_embeddings.weight, config.init_method_std)
        self.position_embeddings = None
        if config.position_embedding_type == "learned_absolute":
            self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
            init_normal_(self.position_embeddings.weight, config.init_method_std)
        self.embedding_dropout = nn.Dropout(config.hidden_dropout)
        self.layers = nn.ModuleList(
            TransformerBlock(config, MLP(config)) for _ in range(config.num_layers)
        )
        self.final_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)

    def forward(
        self,
        tokens_BS: torch.Tensor,
        position_ids_BS: torch.Tensor | None = None,
        labels_BS: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [B, S, V] without labels; fp32 per-token cross entropy [B, S] with them."""
        if position_ids_BS is None:
            position_ids_BS = torch.arange(tokens_BS.shape[1], device=tokens_BS.device).expand_as(tokens_BS)
        x_BSH = self.word_embeddings(tokens_BS)
        if self.position_embeddings is not None:
            x_BSH = x_BSH + self.position_embeddings(position_ids_BS)
        x_BSH = self.embedding_dropout(x_BSH)
        for layer in self.layers:
            if self.config.checkpoint_activations and self.training:
                x_BSH = checkpoint(layer, x_BSH, position_ids_BS, use_reentrant=False)
            else:
                x_BSH = layer(x_BSH, position_ids_BS)
        logits_BSV = F.linear(self.final_layernorm(x_BSH), self.word_embeddings.weight)
        if labels_BS is None:
            return logits_BSV
        return F.cross_entropy(
            logits_BSV.float().flatten(0, 1), labels_BS.flatten(), reduction="none"
        ).view_as(labels_BS)
