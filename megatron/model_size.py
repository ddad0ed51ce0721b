"""How big a model is before it exists: built on the meta device (no memory) from the same flags
as training, it gives total and active parameters, training FLOPs per token, and the memory per
rank for weights, gradients and optimizer state under each ZeRO stage and expert-parallel size.

Memory follows this toolkit's layout: fp32 weights and gradients (bf16/fp16 run under autocast),
Adam's two fp32 moments, and under ZeRO an fp32 master partition. Dense tensors are replicated over
the data-parallel ranks (all ranks) and partitioned over them by ZeRO; experts are split over the
expert-parallel group and partitioned over their expert-data-parallel group. Activations are
not counted: they depend on micro-batch, sequence length and activation checkpointing.
"""

import argparse
import os
from dataclasses import dataclass, replace
from typing import Any

import torch

from megatron.config.flags import PretrainConfig, build_parser, model_config_from_args
from megatron.data.tokenizer import build_tokenizer, padded_vocab_size
from megatron.entry_point import run_entry_point
from megatron.errors import ConfigError, DataError
from megatron.model import GPTConfig, GPTModel
from megatron.model.moe import MoELayer
from megatron.checkpoint.tensors import expert_ids

GIB = 2**30
ZERO_STAGES = (0, 1, 2, 3)


@dataclass(frozen=True)
class ModelSize:
    total: int
    active: int  # parameters one token goes through: k experts of each MoE layer, everything dense
    dense: int  # replicated over data parallelism
    expert: int  # split over expert parallelism
    flops_per_token: float  # training (forward + backward)


@dataclass(frozen=True)
class RankMemory:
    weights: float  # bytes
    gradients: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer


def model_size(config: GPTConfig, seq_length: int) -> ModelSize:
    with torch.device("meta"):
        model = GPTModel(config)
    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    expert = sum(p.numel() for p in params if expert_ids(p) is not None)
    idle = 0  # expert parameters a token skips: (E - k) / E of each MoE layer's experts
    for layer in model.modules():
        if isinstance(layer, MoELayer):
            per_layer = sum(p.numel() for p in layer.experts.parameters())
            idle += per_layer * (layer.num_experts - min(config.moe.topk, layer.num_experts)) // layer.num_experts
    return ModelSize(total, total - idle, total - expert, expert, config.flops_per_token(seq_length))


def rank_memory(size: ModelSize, world_size: int, ep_size: int, zero_stage: int) -> RankMemory:
    """Bytes per rank for `world_size` ranks, experts split `ep_size` ways, ZeRO stage 0-3."""
    replica = size.dense + size.expert / ep_size  # what one rank holds without ZeRO
    shard = size.dense / world_size + (size.expert / ep_size) / (world_size // ep_size)
    return RankMemory(
        weights=4 * (shard if zero_stage >= 3 else replica),
        gradients=4 * (shard if zero_stage >= 2 else replica),
        optimizer=8 * replica if zero_stage == 0 else 12 * shard,  # Adam m, v (+ fp32 master under ZeRO)
    )


def valid_ep_sizes(config: GPTConfig, world_size: int) -> list[int]:
    """Expert-parallel sizes that divide the world and every MoE layer's expert count."""
    counts = [c for c in config.experts_per_layer if c > 1]
    return [ep for ep in range(1, world_size + 1) if world_size % ep == 0 and all(c % ep == 0 for c in counts)] \
        if counts else [1]


def sizing_vocab(flags: dict[str, Any]) -> int:
    """The padded vocabulary: from --vocab-size (GPT-2's is 50257) or else from the tokenizer files."""
    raw = flags.get("vocab_size")
    if flags["tokenizer_type"] == "NullTokenizer" or raw is None:
        try:
            raw = build_tokenizer(flags["tokenizer_type"], tokenizer_model=flags.get("tokenizer_model"),
                                  vocab_file=flags.get("vocab_file"), merge_file=flags.get("merge_file"),
                                  vocab_size=flags.get("vocab_size")).vocab_size
        except (DataError, OSError, TypeError, ValueError) as e:
            raise DataError(f"cannot read the tokenizer to size the vocabulary ({e}); "
                            "give --vocab-size N (50257 for GPT-2) to size the model without its files") from e
    return padded_vocab_size(raw, flags["make_vocab_size_divisible_by"])


def size_report(config: GPTConfig, seq_length: int, world_size: int, chosen_ep: int | None = None) -> list[str]:
    """The lines `pretrain_gpt.py --dry-run` and tools/model_size.py print."""
    size = model_size(config, seq_length)
    lines = [
        f"model: {config.num_layers} layers, hidden {config.hidden_size}, {config.num_attention_heads} heads, "
        f"sequence {seq_length}, vocabulary {config.vocab_size} (padded), experts per layer {config.experts_per_layer}"
        + (f", residual (PR-MoE), top-{config.moe.topk}" if config.mlp_type == "residual" else
           f", top-{config.moe.topk}" if config.is_moe else ""),
        f"total parameters: {size.total}",
        f"active parameters per token: {size.active}",
        f"training FLOPs per token: {size.flops_per_token:.4g} (forward + backward, active parameters only)",
        f"memory per rank in GiB on {world_size} rank(s): fp32 weights and gradients, Adam moments "
        "(+ fp32 master partition under ZeRO); activations not included; * this run's EP size",
        f"{'EP size':>8} {'ZeRO':>5} {'weights':>10} {'gradients':>10} {'optimizer':>10} {'total':>10}",
    ]
    for ep in valid_ep_sizes(config, world_size):
        for stage in ZERO_STAGES:
            m = rank_memory(size, world_size, ep, stage)
            mark = " *" if ep == chosen_ep else ""
            lines.append(f"{ep:>8} {stage:>5} {m.weights / GIB:>10.2f} {m.gradients / GIB:>10.2f} "
                         f"{m.optimizer / GIB:>10.2f} {m.total / GIB:>10.2f}{mark}")
    return lines


def dry_run(config: PretrainConfig, world: int) -> None:
    """`pretrain_gpt.py --dry-run`: the size of the model these (checked) flags train on `world` ranks."""
    model = replace(config.model, vocab_size=sizing_vocab(config.flags))
    if int(os.environ.get("RANK", "0")) == 0:
        print("\n".join(size_report(model, config.training.seq_length, world, config.training.expert_parallel_size)),
              flush=True)


def _size(argv: list[str] | None) -> None:
    parser = build_parser(sizing=True)
    parser.add_argument("--world-size", type=int, default=int(os.environ.get("WORLD_SIZE", "1")),
                        help="ranks to size the memory for (default: WORLD_SIZE or 1)")
    args: argparse.Namespace = parser.parse_args(argv)
    if args.world_size < 1:
        raise ConfigError(f"--world-size must be positive, got {args.world_size}")
    model = replace(model_config_from_args(args), vocab_size=sizing_vocab(vars(args)))
    print("\n".join(size_report(model, args.seq_length, args.world_size, args.moe_expert_parallel_size)), flush=True)


def main(argv: list[str] | None = None) -> None:
    """tools/model_size.py: the model flags of pretrain_gpt.py (training flags optional) + --world-size."""
    run_entry_point(lambda: _size(argv))
