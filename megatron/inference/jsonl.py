"""Reading JSONL documents (one JSON object per line) for evaluation, with errors that name the line."""

import json
import os
from pathlib import Path
from typing import Any

from megatron.errors import DataError


def read_jsonl(path: str | Path, fields: tuple[str, ...]) -> list[dict[str, Any]]:
    """Every non-empty line of `path` as a JSON object that has all of `fields`."""
    if not os.path.isfile(path):
        raise DataError(f"{path} does not exist; pass a file with one JSON object per line")
    docs = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path} line {number} is not JSON ({e}); write one JSON object per line") from e
            missing = [name for name in fields if name not in doc]
            if missing:
                raise DataError(f"{path} line {number} lacks {', '.join(missing)}; every line needs {', '.join(fields)}")
            docs.append(doc)
    return docs
