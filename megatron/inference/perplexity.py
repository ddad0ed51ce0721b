"""`tools/evaluate_ppl.py`: perplexity of a checkpoint on held-out text, from an indexed dataset
(.bin/.idx, as tools/preprocess_data.py writes it) or a JSONL file. The documents are joined into
one token stream (end-of-document tokens between JSONL documents) and read in disjoint windows of
the model's context length, each token predicted once, like the training run's validation loss."""

import argparse
import math
from collections.abc import Iterator

from tqdm import tqdm

from megatron.config.parser import FlagParser, positive_int
from megatron.data.indexed_dataset import MMapIndexedDataset, dataset_exists
from megatron.data.tokenizer import Tokenizer
from megatron.entry_point import run_entry_point
from megatron.errors import ConfigError, DataError
from megatron.inference.checkpoint_model import (
    add_load_args,
    inference_grid,
    load_from_args,
)
from megatron.inference.jsonl import read_jsonl
from megatron.inference.scoring import rolling_windows, score_continuations
from megatron.model import GPTModel


def indexed_tokens(prefix: str) -> Iterator[list[int]]:
    if not dataset_exists(prefix):
        raise DataError(
            f"no {prefix}.bin/.idx; pass the --output-prefix of tools/preprocess_data.py plus _text_document"
        )
    dataset = MMapIndexedDataset(prefix)
    for i in range(len(dataset)):
        yield dataset[i].tolist()


def jsonl_tokens(path: str, key: str, tokenizer: Tokenizer) -> Iterator[list[int]]:
    for doc in read_jsonl(path, (key,)):
        yield tokenizer.tokenize(doc[key]) + [tokenizer.eod]


def token_stream(documents: Iterator[list[int]], max_tokens: int | None) -> list[int]:
    stream: list[int] = []
    for tokens in documents:
        stream += tokens
        if max_tokens is not None and len(stream) >= max_tokens:
            return stream[:max_tokens]
    return stream


def stream_perplexity(
    model: GPTModel, stream: list[int], batch_size: int = 8, progress: bool = False
) -> tuple[float, int]:
    """Mean negative log-likelihood per predicted token, and how many tokens were predicted; with
    `progress`, a bar of tokens scored on stderr."""
    if len(stream) < 2:
        raise DataError("the evaluation text has fewer than 2 tokens; give more text")
    windows = rolling_windows(stream, model.config.max_position_embeddings)
    total = 0.0
    with tqdm(total=len(stream) - 1, desc="perplexity", unit=" tokens", disable=not progress) as bar:
        # one batch per call, so the bar moves as work is done; every window but the last has the
        # model's full length, so these are the batches one call over all windows would form
        for start in range(0, len(windows), batch_size):
            batch = windows[start : start + batch_size]
            total += sum(score.logprob for score in score_continuations(model, batch, batch_size))
            bar.update(sum(len(continuation) for _, continuation in batch))
    return -total / (len(stream) - 1), len(stream) - 1


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
