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
from megatron.config.parser import positive_int
from megatron.data.tokenizer import build_tokenizer, padded_vocab_size
from megatron.entry_point import run_entry_point
from megatron.errors import ConfigError, DataError
from megatron.model import GPTConfig, GPTModel
from megatron.model.moe import MoELayer
from megatron.checkpoint.tensors import expert_ids

GIB = 2**30
ZERO_STAGES = (0, 1, 2, 3)
GPT2_VOCAB = 50257  # the vocabulary of GPT2BPETokenizer, the default --tokenizer-type
DESCRIPTION = ("Size a GPT model from pretrain_gpt.py's model flags without building it or reading any data: "
               "total and active parameters, training FLOPs per token, and memory per rank for weights, "
               "gradients and optimizer state under each ZeRO stage and expert-parallel size. The vocabulary "
               "is --padded-vocab-size, or --vocab-size padded to --make-vocab-size-divisible-by, or read from the "
               f"tokenizer files given, or else GPT-2's {GPT2_VOCAB:,} tokens.")


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
    """The padded vocabulary: from --vocab-size (GPT-2's is GPT2_VOCAB) or else from the tokenizer files."""
    raw = flags.get("vocab_size")
    if flags["tokenizer_type"] == "NullTokenizer" or raw is None:
        try:
            raw = build_tokenizer(flags["tokenizer_type"], tokenizer_model=flags.get("tokenizer_model"),
                                  vocab_file=flags.get("vocab_file"), merge_file=flags.get("merge_file"),
                                  vocab_size=flags.get("vocab_size"),
                                  null_tokenizer_eod=flags["null_tokenizer_eod"]).vocab_size
        except (DataError, OSError, TypeError, ValueError) as e:
            raise DataError(f"cannot read the tokenizer to size the vocabulary ({e}); "
                            f"give --vocab-size N ({GPT2_VOCAB} for GPT-2) to size the model without its files") from e
    return padded_vocab_size(raw, flags["make_vocab_size_divisible_by"])


def with_scale(n: float) -> str:
    """1234567890 -> '1,234,567,890 (1.23B)': the exact number, then three digits to read at a glance."""
    rounded = float(f"{n:.3g}")  # scale after rounding, so that 999,999,999 reads 1B and not 1e+03M
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if rounded >= scale:
            return f"{n:,.0f} ({rounded / scale:g}{suffix})"
    return f"{n:,.0f}"


def model_options(config: GPTConfig) -> str:
    """The Megatron-LM model options that differ from the classic GPT, as a list to read ('' for none)."""
    c = config
    options = [
        (c.num_query_groups is not None, f"{c.kv_heads} query groups"), (c.kv_channels is not None, f"head dim {c.head_dim}"),
        (c.qk_layernorm, "qk norm"), (c.swiglu, "SwiGLU"), (c.normalization != "LayerNorm", c.normalization),
        (not c.add_bias_linear, "no linear biases"), (c.untie_embeddings_and_output_weights, "untied output layer"),
        (c.position_embedding_type != "learned_absolute", f"{c.position_embedding_type} positions"),
        (c.rotary_percent != 1.0, f"rotary percent {c.rotary_percent:g}"),
        (c.is_moe and c.moe_ffn_hidden_size != c.ffn_hidden_size, f"expert ffn {c.moe_ffn_hidden_size}"),
        (c.moe_shared_expert_intermediate_size is not None,
         f"shared experts {c.moe_shared_expert_intermediate_size}{' gated' if c.moe_shared_expert_gate else ''}"),
    ]
    return "".join(f", {text}" for given, text in options if given)


def size_report(config: GPTConfig, seq_length: int, world_size: int, chosen_ep: int | None = None) -> list[str]:
    """The lines `pretrain_gpt.py --dry-run` and tools/model_size.py print."""
    size = model_size(config, seq_length)
    lines = [
        f"model: {config.num_layers} layers, hidden {config.hidden_size}, {config.num_attention_heads} heads"
        f"{model_options(config)}, "
        f"sequence {seq_length:,}, vocabulary {config.vocab_size:,} (padded), "
        f"experts per layer {config.experts_per_layer}"
        + (f", residual (PR-MoE), top-{config.moe.topk}" if config.mlp_type == "residual" else
           f", top-{config.moe.topk}" if config.is_moe else ""),
        f"total parameters: {with_scale(size.total)}",
        f"active parameters per token: {with_scale(size.active)}",
        f"training FLOPs per token: {with_scale(size.flops_per_token)}, forward + backward over the active parameters",
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


def tool_vocab(args: argparse.Namespace) -> tuple[int, str | None]:
    """tools/model_size.py's padded vocabulary, and a note when it is GPT-2's by default (no tokenizer needed)."""
    if args.padded_vocab_size is not None:
        if args.vocab_size is not None:
            raise ConfigError("--vocab-size and --padded-vocab-size both given: give one of them")
        return args.padded_vocab_size, None
    if args.vocab_size is None and args.vocab_file is None and args.tokenizer_model is None:
        padded = padded_vocab_size(GPT2_VOCAB, args.make_vocab_size_divisible_by)
        return padded, (f"note: no --vocab-size, --padded-vocab-size or tokenizer file given: sizing with GPT-2's "
                        f"vocabulary of {GPT2_VOCAB:,} tokens (padded to {padded:,})")
    return sizing_vocab(vars(args)), None


def _size(argv: list[str] | None) -> None:
    parser = build_parser(sizing=True)
    parser.prog, parser.description = "tools/model_size.py", DESCRIPTION  # build_parser's are pretrain_gpt.py's
    parser.add_argument("--padded-vocab-size", type=positive_int, default=None,
                        help="the embedding's row count as is, with no padding added (what a checkpoint holds)")
    parser.add_argument("--world-size", type=positive_int, default=int(os.environ.get("WORLD_SIZE", "1")),
                        help="ranks to size the memory for: WORLD_SIZE where set")
    args: argparse.Namespace = parser.parse_args(argv)
    vocab, note = tool_vocab(args)
    model = replace(model_config_from_args(args), vocab_size=vocab)
    lines = size_report(model, args.seq_length, args.world_size, args.moe_expert_parallel_size)
    print("\n".join([note, *lines] if note else lines), flush=True)


def main(argv: list[str] | None = None) -> None:
    """tools/model_size.py: the model flags of pretrain_gpt.py (training flags optional) + --world-size."""
    run_entry_point(lambda: _size(argv))
