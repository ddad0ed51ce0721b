"""`tools/evaluate_ppl.py`: perplexity of a checkpoint on held-out text (megatron/inference/perplexity.py)."""

import argparse
import math

from megatron.config.parser import FlagParser, positive_int
from megatron.entry_point import run_entry_point
from megatron.errors import ConfigError
from megatron.inference.checkpoint_model import add_load_args, inference_grid, load_from_args
from megatron.inference.perplexity import indexed_tokens, jsonl_tokens, stream_perplexity, token_stream


def build_parser() -> argparse.ArgumentParser:
    parser = FlagParser(description="Perplexity of a checkpoint on held-out text.")
    add_load_args(parser)
    g = parser.add_argument_group("text")
    source = g.add_mutually_exclusive_group(required=True)
    source.add_argument("--data-path", default=None, help="indexed dataset prefix (PREFIX.bin / PREFIX.idx)")
    source.add_argument("--jsonl", default=None, help="a JSONL file of documents")
    g.add_argument("--json-key", default="text")
    g.add_argument("--max-tokens", type=positive_int, default=None, help="evaluate only the first N tokens")
    g.add_argument("--batch-size", type=positive_int, default=8)
    return parser


def main(argv: list[str] | None = None) -> None:
    run_entry_point(lambda: evaluate(build_parser().parse_args(argv)))  # a bad flag is one sentence too


def evaluate(args: argparse.Namespace) -> None:
    if args.max_tokens == 1:
        raise ConfigError("--max-tokens must be at least 2: the first token is only read, never predicted")
    grid = inference_grid()
    loaded = load_from_args(args, grid)
    documents = (
        indexed_tokens(args.data_path) if args.data_path else jsonl_tokens(args.jsonl, args.json_key, loaded.tokenizer)
    )
    stream = token_stream(documents, args.max_tokens)
    loss, count = stream_perplexity(loaded.model, stream, args.batch_size, progress=grid.is_first_rank)
    if grid.is_first_rank:
        print(f"{loaded.folder} | tokens: {count} | lm loss: {loss:.4f} | perplexity: {math.exp(min(loss, 50)):.3f}")
