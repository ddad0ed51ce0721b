"""Reading JSONL documents (one JSON object per line) for evaluation, with errors that name the
line: the corpus reader's JSON lines (megatron/data/corpus_reader.py), each line holding every field."""

import os
from pathlib import Path
from typing import Any

from megatron.data.corpus_reader import READERS, is_utf8
from megatron.errors import DataError


def read_jsonl(path: str | Path, fields: tuple[str, ...]) -> list[dict[str, Any]]:
    """Every non-empty line of `path` as a JSON object that has all of `fields`."""
    if not os.path.isfile(path):
        raise DataError(f"{path} does not exist; pass a file with one JSON object per line")
    docs = []
    for where, doc in READERS[".jsonl"](str(path), list(fields)):
        missing = [name for name in fields if name not in doc]
        if missing:
            raise DataError(f"{where} lacks {', '.join(missing)}; every line needs {', '.join(fields)}")
        if not all(is_utf8(doc[name]) for name in fields if isinstance(doc[name], str)):
            raise DataError(f"{where} holds text that is not valid UTF-8; fix the file's encoding")
        docs.append(doc)
    return docs
