"""GPT language model: token (+ learned position) embeddings -> pre-norm blocks (dense MLP or MoE)
-> final norm -> LM head, tied to the token embedding unless --untie-embeddings-and-output-weights
gives it its own `output_layer`. Returns one `GPTOutput`: logits, or per-token losses when labels
are given, with the summed MoE router loss and each MoE layer's routing statistics. With a
`KVCache` (from `new_kv_cache`) the tokens given are the next ones after those already cached, for
incremental decoding.

Under tensor parallelism (`tp`) the vocabulary is split: the embedding and the LM head hold this
rank's rows, the loss is the vocabulary-parallel cross entropy (the full logits are never
gathered for it) and logits asked for are gathered. With sequence parallelism the blocks work on
this rank's positions between the embedding's scatter and the gather before the final norm.

Under pipeline parallelism (`stage`) the model holds one stage's layers, named by their global
index; the first stage embeds the tokens, the others take the previous stage's hidden states, and
every stage but the last returns its hidden states instead of logits or losses. Every stage builds
the whole model's parameters in order, a layer at a time, and keeps its own, so each starts from
the weights one process would have.

With `random_ltd` set (by the trainer), its layers see a random share of the tokens in training
(megatron/model/random_ltd.py).
"""

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from megatron.errors import ConfigError
from megatron.model.config import GPTConfig
from megatron.model.kv_cache import KVCache, LayerKVCache
from megatron.model.moe import MoELayer
from megatron.model.moe.shared_expert import SharedExpert
from megatron.model.output import GPTOutput
from megatron.model.pipeline_stage import PipelineStage
from megatron.model.random_ltd import RandomLTD, through_kept_tokens
from megatron.model.tensor_parallel import (
    ColumnParallelLinear,
    TensorParallel,
    VocabParallelEmbedding,
    copy_to_tp_region,
    gather_from_tp_region,
    scatter_to_sequence_region,
    sequence_gathered_linear,
    vocab_parallel_cross_entropy,
)
from megatron.model.transformer import MLP, BlockOutput, TransformerBlock, build_norm, init_normal_, output_layer_std
from megatron.placement import place


class StageLayers(nn.ModuleList):
    """A pipeline stage's blocks under their global indices ("layers.5.*" on any stage), so that
    checkpoints do not depend on the split."""

    def __init__(self, blocks: dict[int, nn.Module]) -> None:
        super().__init__()
        for index, block in blocks.items():
            self._modules[str(index)] = block


class GPTModel(nn.Module):
    def __init__(
        self,
        config: GPTConfig,
        ep_group: dist.ProcessGroup | None = None,
        tp: TensorParallel = TensorParallel(),
        stage: PipelineStage | None = None,
    ) -> None:
        super().__init__()
        if config.vocab_size is None:
            raise ValueError(
                "GPTConfig.vocab_size must be set (the padded tokenizer vocabulary) before building the model"
            )
        if tp.enabled and config.is_moe and not tp.sequence_parallel:  # Megatron-Core's rule too
            raise ConfigError(
                f"MoE layers under --tensor-model-parallel-size {tp.size} route each rank's share of the "
                "sequence; add --sequence-parallel"
            )
        self.config = config
        self.tp = tp
        self.stage = stage = stage or PipelineStage(0, 1, 0, config.num_layers)
        self.random_ltd: RandomLTD | None = None  # the trainer's, under a ds_config that turns it on
        tied = not config.untie_embeddings_and_output_weights
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        init_normal_(self.word_embeddings.weight, config.init_method_std)
        if tp.enabled:
            self.word_embeddings = VocabParallelEmbedding(self.word_embeddings, tp.group)
        self.position_embeddings = None
        if config.position_embedding_type == "learned_absolute":
            self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
            init_normal_(self.position_embeddings.weight, config.init_method_std)
        self.embedding_dropout = nn.Dropout(config.hidden_dropout)
        blocks = {}
        for index, experts in enumerate(config.experts_per_layer):  # built and split one at a time
            block = TransformerBlock(config, self._mlp(config, experts, ep_group, tp), tp)
            if index in stage.layers:
                blocks[index] = block
        self.layers = nn.ModuleList(blocks.values()) if stage.size == 1 else StageLayers(blocks)
        self.final_layernorm = build_norm(config, config.hidden_size, tp)
        self.output_layer = None
        if not tied:
            self.output_layer = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            init_normal_(self.output_layer.weight, config.init_method_std)
            if tp.enabled:
                self.output_layer = ColumnParallelLinear(self.output_layer, tp.group)
        if not stage.is_first:
            self.position_embeddings = None
            if not (stage.is_last and tied):
                self.word_embeddings = None
            else:  # the LM head's copy of the first stage's word embedding: gradients summed with it
                place(self.word_embeddings.weight, copy_of_first_stage=True)
        if stage.size > 1 and tied and (stage.is_first or stage.is_last):
            place(self.word_embeddings.weight, pipeline_shared=True)
        if not stage.is_last:
            self.final_layernorm = self.output_layer = None

    @staticmethod
    def _mlp(config: GPTConfig, num_experts: int, ep_group: dist.ProcessGroup | None, tp: TensorParallel) -> nn.Module:
        if num_experts == 1:
            return MLP(config, tp=tp)
        return MoELayer(
            config.hidden_size,
            config.moe_ffn_hidden_size,
            num_experts,
            config.moe,
            init_std=config.init_method_std,
            output_init_std=output_layer_std(config),
            ep_group=ep_group,
            residual_mlp=MLP(config) if config.mlp_type == "residual" else None,
            shared_expert=GPTModel._shared_expert(config),
            swiglu=config.swiglu,
            bias=config.add_bias_linear,
            sequence_group=tp.group if tp.sequence_parallel else None,
            expert_tp_group=tp.expert_group,
        )

    @staticmethod
    def _shared_expert(config: GPTConfig) -> SharedExpert | None:
        width = config.moe_shared_expert_intermediate_size
        if width is None:
            return None
        return SharedExpert(
            MLP(config, width), config.hidden_size, config.moe_shared_expert_gate, config.init_method_std
        )

    def new_kv_cache(self, batch: int, max_length: int | None = None) -> KVCache:
        """An empty cache for `batch` sequences of up to `max_length` tokens (default: the most
        positions the model has)."""
        if self.tp.enabled or self.stage.size > 1:
            raise ConfigError(
                "generation with a key/value cache under tensor or pipeline parallelism is not built "
                "yet; generate from the checkpoint on one process (tools/generate.py loads any layout)"
            )
        c = self.config
        weight = self.word_embeddings.weight
        return KVCache(
            c.num_layers,
            batch,
            c.kv_heads,
            max_length or c.max_position_embeddings,
            c.head_dim,
            dtype=weight.dtype,
            device=weight.device,
        )

    def _layer_call(
        self, layer: TransformerBlock, cache: LayerKVCache | None
    ) -> Callable[[torch.Tensor, torch.Tensor], BlockOutput]:
        """The layer as a function of (hidden states, positions): recomputed in backward under
        activation checkpointing in training, with its KV cache in generation."""
        if self.config.checkpoint_activations and self.training and cache is None:
            return lambda x_BSH, position_ids_BS: checkpoint(layer, x_BSH, position_ids_BS, use_reentrant=False)
        return lambda x_BSH, position_ids_BS: layer(x_BSH, position_ids_BS, cache)

    def forward(
        self,
        tokens_BS: torch.Tensor,
        position_ids_BS: torch.Tensor | None = None,
        labels_BS: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        return_logits: bool = False,
        hidden_BSH: torch.Tensor | None = None,
    ) -> GPTOutput:
        """Logits [B, S, V] without labels; with them, fp32 per-token cross entropy [B, S], and with
        `return_logits` the logits too (distillation needs both, and the LM head then runs once). A
        pipeline stage after the first takes `hidden_BSH` from the previous stage instead of
        embedding the tokens; a stage before the last returns its hidden states."""
        if position_ids_BS is None:
            start = 0 if kv_cache is None else kv_cache.length
            position_ids_BS = torch.arange(start, start + tokens_BS.shape[1], device=tokens_BS.device).expand_as(
                tokens_BS
            )
        if self.stage.is_first:
            x_BSH = self.word_embeddings(tokens_BS)
            if self.position_embeddings is not None:
                x_BSH = x_BSH + self.position_embeddings(position_ids_BS)
            x_BSH = self.embedding_dropout(x_BSH)
            if self.tp.sequence_parallel:
                x_BSH = scatter_to_sequence_region(x_BSH, self.tp.group)
        else:
            x_BSH = hidden_BSH
        output = GPTOutput(router_loss=torch.zeros((), device=x_BSH.device), routing={})
        dropping = (
            self.random_ltd.kept_positions(x_BSH.shape[0], position_ids_BS.shape[1], self.stage.layers, x_BSH.device)
            if self.random_ltd is not None and self.training and kv_cache is None
            else {}
        )
        for local_index, (index, layer) in enumerate(zip(self.stage.layers, self.layers)):
            run = self._layer_call(layer, None if kv_cache is None else kv_cache.layers[local_index])
            if index in dropping:
                block = through_kept_tokens(run, x_BSH, position_ids_BS, dropping[index], self.tp)
            else:
                block = run(x_BSH, position_ids_BS)
            x_BSH = block.hidden_BSH
            output.router_loss = output.router_loss + block.router_loss
            if block.routing is not None:
                output.routing[index + 1] = block.routing
        if not self.stage.is_last:
            output.hidden_BSH = x_BSH
            return output
        head_VH = self.word_embeddings.weight if self.output_layer is None else self.output_layer.weight
        x_BSH = self.final_layernorm(x_BSH)
        # under tensor parallelism this rank's vocabulary rows
        if self.tp.sequence_parallel:
            logits_BSV = sequence_gathered_linear(x_BSH, head_VH, None, self.tp.group)
        else:
            logits_BSV = F.linear(copy_to_tp_region(x_BSH, self.tp.group), head_VH)
        if labels_BS is None or return_logits:
            output.logits_BSV = gather_from_tp_region(logits_BSV, self.tp.group)
        if labels_BS is not None:
            if self.tp.enabled:
                losses_BS = vocab_parallel_cross_entropy(logits_BSV, labels_BS, self.tp.group)
            else:
                losses_BS = F.cross_entropy(logits_BSV.float().flatten(0, 1), labels_BS.flatten(), reduction="none")
            output.losses_BS = losses_BS.view_as(labels_BS)
        return output
