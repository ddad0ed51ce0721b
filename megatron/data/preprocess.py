"""Tokenize a corpus into Megatron indexed datasets (tools/preprocess_data.py).

Each row of the input (.jsonl/.json, .parquet or .csv, read through `datasets`) is one document;
each --json-keys column becomes its own OUTPUT_PREFIX_{key}_document.bin/.idx pair. Rows are
tokenized by a pool of worker processes and written in input order; empty rows are skipped.
"""

import argparse
import contextlib
import functools
import glob
import multiprocessing
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import numpy as np
from tqdm import tqdm

from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder, best_fitting_dtype, bin_path, idx_path
from megatron.data.tokenizer import TOKENIZER_TYPES, Tokenizer, build_tokenizer
from megatron.errors import DataError, UserError

_LOADER_OF_SUFFIX = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
# Rows per task sent to a worker: large enough to amortise inter-process traffic, small enough
# that the progress bar moves smoothly.
_ROWS_PER_TASK = 64


@dataclass(frozen=True)
class TokenizerSpec:
    """What a worker needs to build its own tokenizer; small and hashable, unlike a tokenizer."""

    tokenizer_type: str
    tokenizer_model: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None
    vocab_size: int | None = None

    def build(self) -> Tokenizer:
        return build_tokenizer(**asdict(self))


@functools.lru_cache(maxsize=1)
def _worker_tokenizer(spec: TokenizerSpec) -> Tokenizer:
    """Each worker process builds its tokenizer once, on its first task."""
    return spec.build()


def _encode_row(spec: TokenizerSpec, append_eod: bool, source: str, row: tuple) -> tuple[list[np.ndarray], int]:
    """Token ids of each column of one row (empty when the text is), and the row's text bytes."""
    tokenizer = _worker_tokenizer(spec)
    encoded, num_bytes = [], 0
    for text in row:
        if text is not None and not isinstance(text, str):
            raise DataError(
                f"{source} has a {type(text).__name__} value where text was expected; "
                "pick text columns with --json-keys."
            )
        ids = tokenizer.tokenize(text) if text else []
        if ids and append_eod:
            ids.append(tokenizer.eod)
        encoded.append(np.asarray(ids, dtype=np.int64))
        num_bytes += len(text.encode("utf-8")) if text else 0
    return encoded, num_bytes


def _input_files(pattern: str) -> list[str]:
    files = sorted(glob.glob(pattern)) or ([pattern] if os.path.isfile(pattern) else [])
    if not files:
        raise DataError(f"--input {pattern} matches no file; pass a file or a glob such as 'data/*.jsonl'.")
    suffixes = {os.path.splitext(f)[1].lower() for f in files}
    if len(suffixes) != 1 or not suffixes <= _LOADER_OF_SUFFIX.keys():
        raise DataError(
            f"--input {pattern} has files of type {sorted(suffixes)}; "
            f"give files of one type among {', '.join(_LOADER_OF_SUFFIX)}."
        )
    return files


def _load_rows(files: list[str], source: str):
    os.environ["HF_DATASETS_OFFLINE"] = "1"  # local files only: never reach for the Hub
    import datasets

    loader = _LOADER_OF_SUFFIX[os.path.splitext(files[0])[1].lower()]
    try:
        return datasets.load_dataset(loader, data_files=files, split="train")
    except Exception as e:  # the library raises many types; all mean the file could not be parsed
        raise DataError(
            f"--input {source} could not be read as {loader} ({type(e).__name__}: {e}); check the file format."
        ) from e


def _rows(table, keys: list[str]) -> Iterator[tuple]:
    for batch in table.select_columns(keys).iter(batch_size=1024):
        yield from zip(*(batch[key] for key in keys))


def preprocess(
    input_pattern: str,
    output_prefix: str,
    tokenizer_spec: TokenizerSpec,
    json_keys: list[str],
    append_eod: bool = False,
    workers: int = 1,
    log_interval: int = 100,
) -> list[str]:
    """Write one indexed dataset per key; return their prefixes."""
    tokenizer = tokenizer_spec.build()  # fail on bad tokenizer flags before reading anything
    files = _input_files(input_pattern)
    table = _load_rows(files, input_pattern)
    if len(table) == 0:
        raise DataError(f"--input {input_pattern} has no rows; pass a non-empty corpus.")
    missing = [key for key in json_keys if key not in table.column_names]
    if missing:
        raise DataError(
            f"--input {input_pattern} has no column {missing[0]!r} (columns: {', '.join(table.column_names)}); "
            "fix --json-keys."
        )

    prefixes = [f"{output_prefix}_{key}_document" for key in json_keys]
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    dtype = best_fitting_dtype(tokenizer.vocab_size)
    documents = [0] * len(json_keys)
    encode = functools.partial(_encode_row, tokenizer_spec, append_eod, input_pattern)
    with contextlib.ExitStack() as stack:
        builders = [
            stack.enter_context(MMapIndexedDatasetBuilder(bin_path(p), dtype, tokenizer.vocab_size)) for p in prefixes
        ]
        pool = stack.enter_context(multiprocessing.Pool(workers))
        bar = tqdm(
            pool.imap(encode, _rows(table, json_keys), _ROWS_PER_TASK),
            total=len(table),
            unit=" docs",
            miniters=log_interval,
        )
        start, total_bytes = time.monotonic(), 0
        for row_number, (encoded, num_bytes) in enumerate(bar, start=1):
            for column, tokens in enumerate(encoded):
                if tokens.size:
                    builders[column].add_item(tokens)
                    builders[column].end_document()
                    documents[column] += 1
            total_bytes += num_bytes
            if row_number % log_interval == 0:
                bar.set_postfix_str(
                    f"{total_bytes / 1e6 / max(time.monotonic() - start, 1e-9):.1f} MB/s", refresh=False
                )
        for key, count in zip(json_keys, documents):
            if count == 0:
                raise DataError(
                    f"--input {input_pattern} has no non-empty text under key {key!r}; "
                    "pass a corpus with text or fix --json-keys."
                )
        for builder, prefix in zip(builders, prefixes):
            builder.finalize(idx_path(prefix))
    return prefixes


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Tokenize a corpus into Megatron .bin/.idx files.")
    parser.add_argument("--input", required=True, help="a .jsonl/.json/.parquet/.csv file or a glob of them")
    parser.add_argument("--json-keys", nargs="+", default=["text"], help="columns to tokenize, one output per key")
    parser.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    parser.add_argument("--tokenizer-model", help="SentencePiece model file")
    parser.add_argument("--vocab-file", help="GPT-2 vocab.json")
    parser.add_argument("--merge-file", help="GPT-2 merges.txt")
    parser.add_argument("--vocab-size", type=int, help="NullTokenizer vocabulary size")
    parser.add_argument("--append-eod", action="store_true", help="end every document with the end-of-document token")
    parser.add_argument("--output-prefix", required=True, help="writes OUTPUT_PREFIX_{key}_document.bin/.idx")
    parser.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    parser.add_argument("--log-interval", type=int, default=100, help="documents between progress updates")
    args = parser.parse_args(argv)
    if args.workers < 1 or args.log_interval < 1:
        parser.error("--workers and --log-interval must be at least 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    spec = TokenizerSpec(args.tokenizer_type, args.tokenizer_model, args.vocab_file, args.merge_file, args.vocab_size)
    try:
        prefixes = preprocess(
            args.input, args.output_prefix, spec, args.json_keys, args.append_eod, args.workers, args.log_interval
        )
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    for prefix in prefixes:
        print(f"wrote {prefix}.bin and {prefix}.idx")
