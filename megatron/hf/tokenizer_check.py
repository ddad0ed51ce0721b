"""Whether a Hugging Face tokenizer is ours: the same ids for the same text, then the same text
back from those ids. The texts are a few probes and, for an export, documents of the training
data itself (the indexed data sets the checkpoint's flags name, decoded by our tokenizer), so a
vocabulary is checked on what it was trained for.

One difference is allowed, and reported: how the unknown piece is rendered. SentencePiece decodes
its unknown id as " ⁇ ", transformers as the piece itself ("<unk>"). An export writes a decoder
that renders it as SentencePiece does (tokenizer_files.py); a tokenizer from elsewhere may not.
"""

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from megatron.data.blending import data_prefixes
from megatron.data.indexed_dataset import MMapIndexedDataset, dataset_exists
from megatron.data.tokenizer import NullTokenizer, Tokenizer
from megatron.errors import CheckpointError, DataError

Log = Callable[[str], None]
PROBE_TEXTS = (
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! It's 2024: naïve café, 東京 and 🙂 too.",
    "  two  spaces,\ttabs\nand\n\nnew lines ",
    "x = f(3.14159) + y_2 ** -1  # code",
)
SAMPLED_DOCUMENTS = 32  # per training data set, spread evenly over it
DOCUMENT_TOKENS = 2048  # the first this many tokens of each
SHOWN = 8  # ids (or 4 x SHOWN characters) shown each side of the first difference in a long text


@dataclass(frozen=True)
class CheckText:
    where: str  # "probe text 2", "document 17 of PREFIX"
    text: str


@dataclass(frozen=True)
class Comparison:
    difference: str | None  # how the first text that differs does; None when all agree
    unknown_rendering: str | None  # the one difference allowed: "'<unk>' where ours gives ' ⁇ '"


def require_transformers(what: str) -> Any:
    try:
        import transformers
    except ImportError:
        raise CheckpointError(f"{what} needs transformers; pip install transformers") from None
    return transformers


def probe_texts(ours: Tokenizer) -> list[CheckText]:
    if isinstance(ours, NullTokenizer):
        step = max(ours.vocab_size // 7, 1)
        texts: Sequence[str] = (" ".join(str(i) for i in range(0, ours.vocab_size, step)), f"0 {ours.eod}  1\n2")
    else:
        texts = PROBE_TEXTS
    return [CheckText(f"probe text {number}", text) for number, text in enumerate(texts, 1)]


def training_texts(data_paths: Sequence[str] | None, ours: Tokenizer, log: Log) -> list[CheckText]:
    """Documents spread evenly over each training data set of `data_paths` (a Megatron prefix list,
    [p] or [w1, p1, ...]), as our tokenizer decodes them; a data set that is not there, or that
    holds ids beyond the tokenizer's, is left out with a log line."""
    texts = []
    for prefix in data_prefixes(list(data_paths or [])):
        try:
            data = MMapIndexedDataset(prefix) if dataset_exists(prefix) else None
        except DataError as error:
            log(f" > the training data {prefix} does not read ({error}), so the tokenizer was not checked on it")
            continue
        if data is None:
            log(f" > the training data {prefix} is not there, so the tokenizer was not checked on it")
            continue
        picks = np.unique(np.linspace(0, len(data) - 1, min(SAMPLED_DOCUMENTS, len(data))).round().astype(np.int64))
        documents = {int(i): data.get(int(i), length=min(int(data.sizes[i]), DOCUMENT_TOKENS)) for i in picks}
        largest = max((int(ids.max()) for ids in documents.values() if ids.size), default=-1)
        if largest >= ours.vocab_size:
            log(
                f" > the training data {prefix} holds id {largest}, beyond the tokenizer's {ours.vocab_size}, so it "
                "was not tokenized with it and the tokenizer was not checked on it"
            )
            continue
        texts += [CheckText(f"document {i} of {prefix}", ours.detokenize(ids.tolist())) for i, ids in documents.items()]
    return texts


def _windows(first: Sequence, second: Sequence, width: int) -> tuple[Sequence, Sequence]:
    """Both sequences whole when short, else `width` items each side of where they first differ."""
    if max(len(first), len(second)) <= 4 * width:
        return first, second
    at = next((i for i, (a, b) in enumerate(zip(first, second)) if a != b), min(len(first), len(second)))
    start = max(at - width, 0)
    return first[start : at + width], second[start : at + width]


def _compare_text(text: CheckText, theirs: Any, ours: Tokenizer) -> Comparison:
    """How `theirs` (a transformers tokenizer) differs from `ours` on `text`."""
    ids, expected = theirs(text.text, add_special_tokens=False)["input_ids"], ours.tokenize(text.text)
    if ids != expected:
        got, want = _windows(ids, expected, SHOWN)
        shown = text.text if len(text.text) <= 8 * SHOWN else ours.detokenize(want)
        return Comparison(
            f"it splits {text.where} ({shown!r}) into ids {list(got)} where ours gives {list(want)}", None
        )
    decoded, own = theirs.decode(ids), ours.detokenize(ids)
    if decoded == own:
        return Comparison(None, None)
    unknown = ours.unknown_id
    known = [i for i in ids if i != unknown]
    if unknown in ids and theirs.decode(known) == ours.detokenize(known):
        return Comparison(None, f"{theirs.decode([unknown])!r} where ours gives {ours.detokenize([unknown])!r}")
    got, want = _windows(decoded, own, 4 * SHOWN)
    return Comparison(f"it decodes {text.where} as {got!r} where ours gives {want!r}", None)


def compare(ours: Tokenizer, folder: Path, texts: Sequence[CheckText]) -> Comparison:
    """How the tokenizer AutoTokenizer loads from `folder` differs from `ours` on `texts`."""
    theirs = require_transformers("checking the tokenizer").AutoTokenizer.from_pretrained(str(folder))
    theirs.model_max_length = sys.maxsize  # whole documents are compared: no warning about a model's input length
    rendering = None
    for text in texts:
        found = _compare_text(text, theirs, ours)
        if found.difference:
            return Comparison(found.difference, rendering)
        rendering = rendering or found.unknown_rendering
    return Comparison(None, rendering)
