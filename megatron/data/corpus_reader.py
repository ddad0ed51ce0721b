"""The rows of a corpus to tokenize, read in order with their file and line: JSON lines (.jsonl,
or .json holding one object per line or one list of objects), CSV with a header row, and Parquet.
Every value used is checked here, so a bad one stops the run with a sentence naming its file and
line (row, for Parquet and JSON lists): not JSON, not an object, a number or list where text
belongs, text that is not valid UTF-8 (or, with skip_invalid_utf8, the row is skipped)."""

import contextlib
import csv
import glob
import json
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any, TextIO

from megatron.errors import DataError

Record = dict[str, Any]  # one input row: column -> value, as the file holds it
Texts = tuple[str | None, ...]  # a row's text under each key, None where null or missing


def open_text(path: str) -> TextIO:
    # utf-8-sig drops a leading byte-order mark. Bytes that are not UTF-8 become lone surrogates
    # (surrogateescape) instead of failing the read, so that _row_texts finds them in the row that
    # uses them and names its line. Lines end at "\n" only, as JSON lines and CSV records do.
    return open(path, encoding="utf-8-sig", errors="surrogateescape", newline="\n")


_KINDS = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list", dict: "an object"}


def _kind(value: Any) -> str:
    return _KINDS.get(type(value), f"a {type(value).__name__} value")


def _json_object(where: str, value: Any) -> Record:
    if not isinstance(value, dict):
        raise DataError(f"{where} is {_kind(value)}, not a JSON object; make every row an object holding the text.")
    return value


def _json_lines(path: str, lines: TextIO) -> Iterator[tuple[str, Record]]:
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path} line {number}"
        try:
            value = json.loads(line.rstrip("\r\n"))  # so that a cut-off line's error column is its end
        except json.JSONDecodeError as e:
            raise DataError(f"{where} is not valid JSON ({e.msg} at column {e.colno}); fix or drop the line.") from None
        yield where, _json_object(where, value)


def _jsonl_records(path: str, keys: list[str]) -> Iterator[tuple[str, Record]]:
    with open_text(path) as lines:
        yield from _json_lines(path, lines)


def _json_records(path: str, keys: list[str]) -> Iterator[tuple[str, Record]]:
    """A .json file is either JSON lines or one list of objects, told apart by its first character."""
    with open_text(path) as f:
        while (first := f.read(1)).isspace():
            pass
        f.seek(0)
        if first != "[":
            yield from _json_lines(path, f)
            return
        try:
            rows = json.load(f)
        except json.JSONDecodeError as e:
            where = f"{path} line {e.lineno}"
            raise DataError(f"{where} is not valid JSON ({e.msg} at column {e.colno}); fix the file.") from None
    for number, value in enumerate(rows, start=1):
        where = f"{path} row {number}"
        yield where, _json_object(where, value)


def _csv_records(path: str, keys: list[str]) -> Iterator[tuple[str, Record]]:
    csv.field_size_limit(sys.maxsize)  # a document can be longer than the default 128 KiB field
    with open_text(path) as f:
        reader = csv.reader(f)
        try:
            header = next(reader, [])
            last_line = reader.line_num
            for values in reader:
                first_line, last_line = last_line + 1, reader.line_num  # a quoted field can span lines
                if values:  # else a blank line
                    yield f"{path} line {first_line}", dict(zip(header, values))  # a short row misses keys
        except csv.Error as e:
            raise DataError(f"{path} line {reader.line_num} is not valid CSV ({e}); fix that line.") from None


def _parquet_records(path: str, keys: list[str]) -> Iterator[tuple[str, Record]]:
    import pyarrow
    import pyarrow.parquet

    try:
        parquet = pyarrow.parquet.ParquetFile(path)
        present = [key for key in keys if key in parquet.schema_arrow.names]
        number = 0
        for batch in parquet.iter_batches(columns=present):
            # Text is read as bytes (pyarrow would raise on invalid UTF-8 with no row number) and decoded in _text.
            columns = {key: _as_bytes(batch.column(key)).to_pylist() for key in present}
            for row in range(batch.num_rows):  # rows count even when no key is a column here
                number += 1
                yield f"{path} row {number}", {key: values[row] for key, values in columns.items()}
    except pyarrow.ArrowException as e:
        raise DataError(f"{path} could not be read as Parquet ({e}); check the file.") from None


def _as_bytes(column: Any) -> Any:
    import pyarrow

    if pyarrow.types.is_string(column.type):
        return column.cast(pyarrow.binary())
    if pyarrow.types.is_large_string(column.type):
        return column.cast(pyarrow.large_binary())
    return column


# Each reader yields (where, record) for every row of one file, where names the file and line or row.
READERS: dict[str, Callable[[str, list[str]], Iterator[tuple[str, Record]]]] = {
    ".jsonl": _jsonl_records,
    ".json": _json_records,
    ".csv": _csv_records,
    ".parquet": _parquet_records,
}


def suffix(path: str) -> str:
    return os.path.splitext(path)[1].lower()


def _text(where: str, key: str, value: Any) -> str | None:
    if isinstance(value, bytes):  # Parquet text (see _parquet_records)
        value = value.decode("utf-8", "surrogateescape")
    if value is None or isinstance(value, str):
        return value
    raise DataError(
        f"{where} has {_kind(value)} under {key!r} where text was expected; "
        "fix that row or pick text columns with --json-keys."
    )


def is_utf8(text: str) -> bool:
    """False for text holding lone surrogates: input bytes that were not UTF-8 (see open_text), or JSON
    escapes such as \\ud800."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _row_texts(where: str, record: Record, keys: list[str], skip_invalid_utf8: bool) -> Texts | None:
    """The row's text under each key; None when the row is skipped for text that is not valid UTF-8."""
    texts = []
    for key in keys:
        text = _text(where, key, record.get(key))
        if text and not is_utf8(text):
            if skip_invalid_utf8:
                return None
            raise DataError(
                f"{where} has text under {key!r} that is not valid UTF-8; fix the file's encoding "
                "or pass --skip-invalid-utf8 to skip such rows."
            )
        texts.append(text)
    return tuple(texts)


def corpus_rows(files: list[str], keys: list[str], skip_invalid_utf8: bool) -> Iterator[Texts | None]:
    for path in files:
        for where, record in READERS[suffix(path)](path, keys):
            yield _row_texts(where, record, keys, skip_invalid_utf8)


def first_row_columns(path: str) -> list[str]:
    """The column names of a file's first row (all columns, for Parquet), to show what --json-keys can pick."""
    if suffix(path) == ".parquet":
        import pyarrow.parquet

        return pyarrow.parquet.read_schema(path).names
    with contextlib.closing(READERS[suffix(path)](path, [])) as records:
        _, record = next(records, ("", {}))
    return [str(column) for column in record if column is not None]


def input_files(pattern: str) -> list[str]:
    files = sorted(f for f in glob.glob(pattern) if os.path.isfile(f)) or ([pattern] if os.path.isfile(pattern) else [])
    if not files:
        raise DataError(f"--input {pattern} matches no file; pass a file or a glob such as 'data/*.jsonl'.")
    suffixes = {suffix(f) for f in files}
    if len(suffixes) != 1 or not suffixes <= READERS.keys():
        raise DataError(
            f"--input {pattern} has files of type {sorted(suffixes)}; "
            f"give files of one type among {', '.join(READERS)}."
        )
    return files
