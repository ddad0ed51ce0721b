"""Perplexity of a model on held-out text, from an indexed dataset (.bin/.idx, as
tools/preprocess_data.py writes it) or a JSONL file; the tool is megatron/cli/evaluate_ppl.py. The
documents are joined into one token stream (end-of-document tokens between JSONL documents) and
read in disjoint windows of the model's context length, each token predicted once, like the
training run's validation loss."""

from collections.abc import Iterator

from tqdm import tqdm

from megatron.data.indexed_dataset import MMapIndexedDataset, dataset_exists
from megatron.data.tokenizer import Tokenizer
from megatron.errors import DataError
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
