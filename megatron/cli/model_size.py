"""`tools/model_size.py`: a model's size and memory per rank from pretrain_gpt.py's flags (megatron/model_size.py)."""

import argparse
import os
from dataclasses import replace

from megatron.config.flags import build_parser, model_config_from_args
from megatron.config.parser import FlagParser, positive_int
from megatron.entry_point import run_entry_point
from megatron.errors import ConfigError
from megatron.model_size import GPT2_VOCAB, Layout, Vocabulary, size_report, sizing_vocab
from megatron.tokenizer_spec import tokenizer_spec_of

DESCRIPTION = (
    "Size a GPT model from pretrain_gpt.py's model flags without building it or reading any data: "
    "total and active parameters, training FLOPs per token, and memory per rank for weights, "
    "gradients and optimizer state under each ZeRO stage and expert-parallel size at the given "
    "--tensor-model-parallel-size and --pipeline-model-parallel-size, then for every tensor x pipeline "
    "layout of --world-size at --zero-stage. The vocabulary "
    "is --padded-vocab-size, or --vocab-size padded to --make-vocab-size-divisible-by x TP, or read from the "
    f"tokenizer files given, or else GPT-2's {GPT2_VOCAB:,} tokens."
)


def tool_vocab(args: argparse.Namespace) -> tuple[Vocabulary, str | None]:
    """tools/model_size.py's vocabulary, and a note when it is GPT-2's by default (no tokenizer needed)."""
    if args.padded_vocab_size is not None:
        if args.vocab_size is not None:
            raise ConfigError("--vocab-size and --padded-vocab-size both given: give one of them")
        return Vocabulary(args.padded_vocab_size), None
    if args.vocab_size is None and args.vocab_file is None and args.tokenizer_model is None:
        vocabulary = Vocabulary(GPT2_VOCAB, args.make_vocab_size_divisible_by)
        return vocabulary, (
            f"note: no --vocab-size, --padded-vocab-size or tokenizer file given: sizing with GPT-2's "
            f"vocabulary of {GPT2_VOCAB:,} tokens (padded to {vocabulary.rows(args.tensor_model_parallel_size):,})"
        )
    return sizing_vocab(tokenizer_spec_of(args), args.make_vocab_size_divisible_by), None


def build_size_parser() -> FlagParser:
    parser = build_parser(sizing=True)
    parser.prog, parser.description = "tools/model_size.py", DESCRIPTION  # build_parser's are pretrain_gpt.py's
    parser.add_argument(
        "--padded-vocab-size",
        type=positive_int,
        default=None,
        help="the embedding's row count as is, with no padding added (what a checkpoint holds)",
    )
    parser.add_argument(
        "--world-size",
        type=positive_int,
        default=int(os.environ.get("WORLD_SIZE", "1")),
        help="ranks to size the memory for: WORLD_SIZE where set",
    )
    return parser


def _size(argv: list[str] | None) -> None:
    args: argparse.Namespace = build_size_parser().parse_args(argv)
    layout = Layout(
        args.tensor_model_parallel_size,
        args.pipeline_model_parallel_size,
        args.moe_expert_parallel_size,
        args.decoder_first_pipeline_num_layers,
        args.decoder_last_pipeline_num_layers,
        args.expert_tensor_parallel_size,
    )
    vocabulary, note = tool_vocab(args)
    model = replace(model_config_from_args(args), vocab_size=vocabulary.rows(layout.tp_size))
    lines = size_report(model, args.seq_length, args.world_size, layout, args.zero_stage, vocabulary)
    print("\n".join([note, *lines] if note else lines), flush=True)


def main(argv: list[str] | None = None) -> None:
    """tools/model_size.py: the model flags of pretrain_gpt.py (training flags optional) + --world-size."""
    run_entry_point(lambda: _size(argv))
