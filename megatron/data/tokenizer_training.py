"""Train a SentencePiece tokenizer on plain-text files or a corpus of records (tools/train_tokenizer.py).

Plain text gives one sentence per non-empty line; .jsonl/.json/.csv/.parquet give the non-empty
lines of the --json-keys fields of each record, read and checked as tools/preprocess_data.py reads
them (corpus_reader.py), so a bad row is one sentence naming its file and line (whole documents
would exceed SentencePiece's sentence length and be skipped). Sentences are streamed to
SentencePiece, so the corpus never has to fit in a list.
"""

import os
from collections.abc import Iterator

from tqdm import tqdm

from megatron.data.corpus_reader import READERS, corpus_rows, is_utf8, open_text, suffix
from megatron.errors import DataError


def _text_lines(path: str) -> Iterator[str]:
    with open_text(path) as lines:
        for number, line in enumerate(lines, start=1):
            if not is_utf8(line):
                raise DataError(f"{path} line {number} is not valid UTF-8; fix the file's encoding.")
            if line.strip():
                yield line.rstrip("\r\n")


def _read_sentences(path: str, json_keys: list[str]) -> Iterator[str]:
    if suffix(path) not in READERS:
        yield from tqdm(_text_lines(path), desc=os.path.basename(path), unit=" lines")
        return
    for texts in tqdm(
        corpus_rows([path], json_keys, skip_invalid_utf8=False), desc=os.path.basename(path), unit=" rows"
    ):
        for text in texts or ():
            yield from (part for part in (text or "").splitlines() if part.strip())


def train_tokenizer(
    inputs: list[str],
    vocab_size: int,
    model_prefix: str,
    model_type: str = "bpe",
    json_keys: list[str] | None = None,
    character_coverage: float = 0.9995,
    max_sentence_length: int = 4192,
) -> str:
    """Train and write MODEL_PREFIX.model / .vocab; return the .model path."""
    import sentencepiece

    missing = [p for p in inputs if not os.path.isfile(p)]
    if missing:
        raise DataError(f"--input {missing[0]} does not exist; pass existing text or .jsonl files.")
    keys = json_keys or ["text"]
    sentences_seen = 0

    def sentences() -> Iterator[str]:
        nonlocal sentences_seen
        for path in inputs:
            for sentence in _read_sentences(path, keys):
                sentences_seen += 1
                yield sentence

    os.makedirs(os.path.dirname(os.path.abspath(model_prefix)), exist_ok=True)
    try:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=sentences(),
            model_prefix=model_prefix,
            vocab_size=vocab_size,
            model_type=model_type,
            character_coverage=character_coverage,
            max_sentence_length=max_sentence_length,
            byte_fallback=model_type == "bpe",  # unseen characters become bytes instead of <unk>
            unk_id=0,
            bos_id=1,
            eos_id=2,  # the end-of-document token SentencePieceTokenizer needs
            pad_id=-1,
            minloglevel=1,  # its per-merge log drowns the progress bar
        )
    except RuntimeError as e:
        if sentences_seen == 0:
            raise DataError(f"no text found in {', '.join(inputs)} (keys {keys}); pass a non-empty corpus.") from e
        raise DataError(
            f"SentencePiece could not train on {', '.join(inputs)} ({str(e).rstrip('.')}); "
            "adjust --vocab-size or the corpus."
        ) from e
    return model_prefix + ".model"
