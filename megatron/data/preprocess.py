"""Tokenize a corpus into Megatron indexed datasets (tools/preprocess_data.py).

Each row of the input is one document; each --json-keys key becomes its own
OUTPUT_PREFIX_{key}_document.bin/.idx pair. Inputs: JSON lines (.jsonl, or .json holding one
object per line or one list of objects), CSV with a header row, and Parquet. This process reads
the rows in order and checks every value it uses, so a bad one stops the run with a sentence
naming its file and line (row, for Parquet and JSON lists); a pool of workers tokenizes them.

Text that tokenizes to nothing (empty text, or only spaces for some tokenizers) gives an empty
document, as Megatron-LM's tools/preprocess_data.py writes it: no sequence and no end-of-document
token, even with --append-eod, only its doc_idx entry. Null or missing text gives no document,
and is counted and reported at the end. Text that is not valid UTF-8 stops the run, or with
--skip-invalid-utf8 drops its row, also counted and reported.
"""

import contextlib
import functools
import multiprocessing
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from megatron.data.corpus_reader import Texts, corpus_rows, first_row_columns, input_files
from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder, best_fitting_dtype, bin_path, idx_path
from megatron.data.tokenizer import Tokenizer, tokenizer_of
from megatron.errors import DataError
from megatron.tokenizer_spec import TokenizerSpec

# Rows per task sent to a worker: large enough to amortise inter-process traffic, small enough
# that the progress bar moves smoothly.
_ROWS_PER_TASK = 64

Encoded = tuple[list[np.ndarray | None], int]  # token ids per key (None: no text), the row's text bytes


@functools.lru_cache(maxsize=1)
def _worker_tokenizer(spec: TokenizerSpec) -> Tokenizer:
    """Each worker process builds its tokenizer once, on its first task."""
    return tokenizer_of(spec)


def _encode_row(spec: TokenizerSpec, append_eod: bool, texts: Texts | None) -> Encoded | None:
    """Token ids of each text of a row, and its text bytes; None for a row skipped as invalid UTF-8."""
    if texts is None:
        return None
    tokenizer = _worker_tokenizer(spec)
    encoded, num_bytes = [], 0
    for text in texts:
        if text is None:
            encoded.append(None)
            continue
        ids = tokenizer.tokenize(text) if text else []
        if ids and append_eod:
            ids.append(tokenizer.eod)
        encoded.append(np.asarray(ids, dtype=np.int64))
        num_bytes += len(text.encode("utf-8"))
    return encoded, num_bytes


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


@dataclass
class _Counts:
    """What a run saw: rows read and rows skipped as invalid UTF-8; per key, documents with tokens and null texts."""

    rows: int
    invalid_utf8: int
    documents_with_tokens: list[int]
    null_or_missing: list[int]


def _check_every_key_has_documents(input_pattern: str, files: list[str], keys: list[str], counts: _Counts) -> None:
    if counts.rows == 0:
        raise DataError(f"--input {input_pattern} has no rows; pass a non-empty corpus.")
    if counts.invalid_utf8 == counts.rows:
        raise DataError(
            f"--input {input_pattern} has no row whose text is valid UTF-8 (all {counts.rows} skipped); "
            "fix the file's encoding."
        )
    for key, documents, nulls in zip(keys, counts.documents_with_tokens, counts.null_or_missing):
        if documents == 0 and nulls == counts.rows - counts.invalid_utf8:
            raise DataError(
                f"--input {input_pattern} has no column {key!r} with text in any row (its first row has "
                f"columns: {', '.join(first_row_columns(files[0]))}); fix --json-keys."
            )
        if documents == 0:
            raise DataError(
                f"--input {input_pattern} has no non-empty text under key {key!r}; "
                "pass a corpus with text or fix --json-keys."
            )


def _skipped_rows_summary(keys: list[str], counts: _Counts) -> list[str]:
    lines = [
        f"skipped {_plural(count, 'row')} whose {key!r} was null or missing"
        for key, count in zip(keys, counts.null_or_missing)
        if count
    ]
    if counts.invalid_utf8:
        lines.append(f"skipped {_plural(counts.invalid_utf8, 'row')} with text that is not valid UTF-8")
    return lines


def _tokenize_rows(
    results: Iterator[Encoded | None], builders: list[MMapIndexedDatasetBuilder], log_interval: int
) -> _Counts:
    """Write each row's documents in input order, and count what was skipped."""
    counts = _Counts(
        rows=0, invalid_utf8=0, documents_with_tokens=[0] * len(builders), null_or_missing=[0] * len(builders)
    )
    # On stdout, so that stderr holds nothing but an error's one sentence; closed (ending its line)
    # before an error from the rows is printed.
    with tqdm(results, unit=" rows", miniters=log_interval, file=sys.stdout) as bar:
        start, total_bytes = time.monotonic(), 0
        for result in bar:
            counts.rows += 1
            if result is None:
                counts.invalid_utf8 += 1
                continue
            encoded, num_bytes = result
            for column, tokens in enumerate(encoded):
                if tokens is None:
                    counts.null_or_missing[column] += 1
                else:
                    builders[column].add_document(tokens)
                    counts.documents_with_tokens[column] += bool(tokens.size)
            total_bytes += num_bytes
            if counts.rows % log_interval == 0:
                bar.set_postfix_str(
                    f"{total_bytes / 1e6 / max(time.monotonic() - start, 1e-9):.1f} MB/s", refresh=False
                )
    return counts


def preprocess(
    input_pattern: str,
    output_prefix: str,
    tokenizer_spec: TokenizerSpec,
    json_keys: list[str],
    append_eod: bool = False,
    workers: int = 1,
    log_interval: int = 100,
    skip_invalid_utf8: bool = False,
) -> list[str]:
    """Write one indexed dataset per key; return their prefixes. Prints a line for each kind of row skipped."""
    tokenizer = tokenizer_of(tokenizer_spec)  # fail on bad tokenizer flags before reading anything
    files = input_files(input_pattern)
    prefixes = [f"{output_prefix}_{key}_document" for key in json_keys]
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    dtype = best_fitting_dtype(tokenizer.vocab_size)
    encode = functools.partial(_encode_row, tokenizer_spec, append_eod)
    with contextlib.ExitStack() as stack:
        builders = [
            stack.enter_context(MMapIndexedDatasetBuilder(bin_path(p), dtype, tokenizer.vocab_size)) for p in prefixes
        ]
        pool = stack.enter_context(multiprocessing.Pool(workers))
        results = pool.imap(encode, corpus_rows(files, json_keys, skip_invalid_utf8), _ROWS_PER_TASK)
        counts = _tokenize_rows(results, builders, log_interval)
        _check_every_key_has_documents(input_pattern, files, json_keys, counts)
        for builder, prefix in zip(builders, prefixes):
            builder.finalize(idx_path(prefix))
    for line in _skipped_rows_summary(json_keys, counts):
        print(line)
    return prefixes
