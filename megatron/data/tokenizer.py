"""Tokenizers: text <-> token ids, plus the end-of-document id that separates documents.

Three kinds, chosen by Megatron's `--tokenizer-type`: a SentencePiece model, GPT-2's byte-level
BPE (vocab.json + merges.txt, implemented here), and a Null tokenizer whose "text" is already ids.
"""

import functools
import itertools
import json
import os
import re
from abc import ABC, abstractmethod
from collections.abc import Sequence

from megatron.errors import ConfigError, DataError
from megatron.tokenizer_spec import NULL_EOD_CONVENTIONS, NULL_EOD_EXTRA, NULL_EOD_LAST, TokenizerSpec


class Tokenizer(ABC):
    """Maps text to ids and back; `vocab_size` is the number of ids before any padding."""

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    @property
    @abstractmethod
    def eod(self) -> int: ...

    @abstractmethod
    def tokenize(self, text: str) -> list[int]: ...

    @abstractmethod
    def detokenize(self, ids: Sequence[int]) -> str: ...

    @property
    def unknown_id(self) -> int | None:
        """The id text outside the vocabulary becomes, where there is one."""
        return None


def _require_file(path: str, flag: str) -> None:
    if not os.path.isfile(path):
        raise DataError(f"{flag} {path} does not exist; pass the path of an existing file.")


class SentencePieceTokenizer(Tokenizer):
    def __init__(self, model_file: str) -> None:
        import sentencepiece

        _require_file(model_file, "--tokenizer-model")
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=model_file)
        except (RuntimeError, OSError) as e:
            raise DataError(
                f"--tokenizer-model {model_file} is not a SentencePiece model ({e}); "
                "train one with tools/train_tokenizer.py."
            ) from e
        self._eod = self._sp.eos_id()
        if self._eod < 0:
            raise DataError(
                f"SentencePiece model {model_file} has no end-of-sentence token; "
                "retrain it with an eos id (tools/train_tokenizer.py does)."
            )

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def eod(self) -> int:
        return self._eod

    def tokenize(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    @property
    def unknown_id(self) -> int | None:
        return self._sp.unk_id()  # SentencePiece's trainer always makes one


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table, so BPE works on visible strings.

    Printable Latin-1 bytes map to themselves; the other 68 (controls, space, 0x7f-0xa0, 0xad)
    map to code points 256, 257, ... in byte order.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    shifted = 256
    for b in range(256):
        if b not in table:
            table[b] = chr(shifted)
            shifted += 1
    return table


# GPT-2 splits text with \p{L} (letters) and \p{N} (numbers), which stdlib `re` lacks. We use
# [^\W\d_] for letters (word characters that are not decimal digits or "_") and \d for numbers.
# The one difference: numerics that are not decimal digits ("²", "½", "Ⅻ") group with letters.
# Every character still falls into some branch, so byte-level round trips stay exact.
_PRETOKENIZE = re.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d+| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+""")
_ENDOFTEXT = "<|endoftext|>"
_BPE_CACHE_WORDS = 1 << 16  # bounded, so long preprocessing runs do not grow without limit


class GPT2BPETokenizer(Tokenizer):
    """GPT-2 byte-level BPE from a local vocab.json (piece -> id) and merges.txt (ranked pairs)."""

    def __init__(self, vocab_file: str, merge_file: str) -> None:
        _require_file(vocab_file, "--vocab-file")
        _require_file(merge_file, "--merge-file")
        try:
            with open(vocab_file, encoding="utf-8") as f:
                self._encoder: dict[str, int] = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DataError(
                f"--vocab-file {vocab_file} is not a JSON object of piece -> id ({e}); pass GPT-2's vocab.json."
            ) from e
        self._decoder = {i: piece for piece, i in self._encoder.items()}
        self._byte_encoder = _bytes_to_unicode()
        self._byte_decoder = {c: b for b, c in self._byte_encoder.items()}
        missing = [c for c in self._byte_encoder.values() if c not in self._encoder]
        if missing:
            raise DataError(
                f"--vocab-file {vocab_file} lacks {len(missing)} of the 256 byte pieces, "
                "so it is not a byte-level BPE vocabulary; "
                "pass GPT-2's vocab.json."
            )
        if _ENDOFTEXT not in self._encoder:
            raise DataError(
                f"--vocab-file {vocab_file} has no {_ENDOFTEXT} token to end documents with; "
                "add it or pass GPT-2's vocab.json."
            )
        self._ranks = self._read_merges(merge_file)
        self._bpe = functools.lru_cache(maxsize=_BPE_CACHE_WORDS)(self._bpe_uncached)

    @staticmethod
    def _read_merges(merge_file: str) -> dict[tuple[str, str], int]:
        ranks: dict[tuple[str, str], int] = {}
        with open(merge_file, encoding="utf-8") as f:
            for line_number, line in enumerate(f, start=1):
                if line.startswith("#version") or not line.strip():
                    continue
                pair = line.split()
                if len(pair) != 2:
                    raise DataError(
                        f"--merge-file {merge_file} line {line_number} is not two space-separated pieces; "
                        "pass GPT-2's merges.txt."
                    )
                ranks[(pair[0], pair[1])] = len(ranks)
        return ranks

    @property
    def vocab_size(self) -> int:
        return len(self._encoder)

    @property
    def eod(self) -> int:
        return self._encoder[_ENDOFTEXT]

    def _bpe_uncached(self, word: str) -> tuple[str, ...]:
        """Merge the lowest-ranked adjacent pair everywhere, repeatedly, until no pair has a rank."""
        parts = list(word)
        while len(parts) > 1:
            pairs = list(itertools.pairwise(parts))
            best = min(pairs, key=lambda pair: self._ranks.get(pair, len(self._ranks)))
            if best not in self._ranks:
                break
            merged: list[str] = []
            i = 0
            while i < len(parts):
                if i + 1 < len(parts) and (parts[i], parts[i + 1]) == best:
                    merged.append(parts[i] + parts[i + 1])
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = merged
        return tuple(parts)

    def tokenize(self, text: str) -> list[int]:
        ids: list[int] = []
        for word in _PRETOKENIZE.findall(text):
            visible = "".join(self._byte_encoder[b] for b in word.encode("utf-8"))
            # A merged piece missing from vocab.json would mean the two files do not belong together.
            try:
                ids.extend(self._encoder[piece] for piece in self._bpe(visible))
            except KeyError as e:
                raise DataError(
                    f"BPE produced piece {e.args[0]!r} that --vocab-file lacks; "
                    "--vocab-file and --merge-file must come from the same tokenizer."
                ) from e
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        try:
            visible = "".join(self._decoder[int(i)] for i in ids)
        except KeyError as e:
            raise DataError(f"token id {e.args[0]} is not in this GPT-2 vocabulary of {self.vocab_size} ids.") from e
        return bytes(self._byte_decoder[c] for c in visible).decode("utf-8", errors="replace")


class NullTokenizer(Tokenizer):
    """Text is space-separated ids; the end-of-document id is placed by `eod_convention` (tokenizer_spec.py)."""

    def __init__(self, vocab_size: int, eod_convention: str = NULL_EOD_LAST) -> None:
        if eod_convention not in NULL_EOD_CONVENTIONS:
            raise ConfigError(
                f"--null-tokenizer-eod {eod_convention!r} is not a convention; choose one of "
                f"{', '.join(NULL_EOD_CONVENTIONS)}."
            )
        self._vocab_size = int(vocab_size) + (eod_convention == NULL_EOD_EXTRA)
        self._eod = self._vocab_size - 1

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._eod

    def tokenize(self, text: str) -> list[int]:
        try:
            ids = [int(word) for word in text.split()]
        except ValueError as e:
            raise DataError(
                f"NullTokenizer text must be space-separated integer ids, got {text[:40]!r}; "
                "use another --tokenizer-type for raw text."
            ) from e
        bad = [i for i in ids if not 0 <= i <= self._eod]
        if bad:
            raise DataError(
                f"NullTokenizer id {bad[0]} is outside 0..{self._eod}; "
                "raise --vocab-size above the largest id in the data."
            )
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


def padded_vocab_size(vocab_size: int, divisible_by: int = 128) -> int:
    """Round the vocabulary up so the embedding splits evenly (and runs fast) across devices."""
    if divisible_by < 1:
        raise ConfigError(
            f"vocabulary padding multiple must be at least 1, got {divisible_by}; fix --make-vocab-size-divisible-by."
        )
    return -(-vocab_size // divisible_by) * divisible_by


TOKENIZER_TYPES = ("SentencePieceTokenizer", "GPT2BPETokenizer", "NullTokenizer")


def _require_flag(value, flag: str, tokenizer_type: str) -> None:
    if value is None:
        raise ConfigError(f"--tokenizer-type {tokenizer_type} needs {flag}; pass it.")


def build_tokenizer(
    tokenizer_type: str,
    tokenizer_model: str | None = None,
    vocab_file: str | None = None,
    merge_file: str | None = None,
    vocab_size: int | None = None,
    null_tokenizer_eod: str = NULL_EOD_LAST,
) -> Tokenizer:
    if tokenizer_type == "SentencePieceTokenizer":
        _require_flag(tokenizer_model, "--tokenizer-model", tokenizer_type)
        return SentencePieceTokenizer(tokenizer_model)
    if tokenizer_type == "GPT2BPETokenizer":
        _require_flag(vocab_file, "--vocab-file", tokenizer_type)
        _require_flag(merge_file, "--merge-file", tokenizer_type)
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type == "NullTokenizer":
        _require_flag(vocab_size, "--vocab-size", tokenizer_type)
        return NullTokenizer(vocab_size, null_tokenizer_eod)
    raise ConfigError(f"unknown --tokenizer-type {tokenizer_type!r}; choose one of {', '.join(TOKENIZER_TYPES)}.")


def tokenizer_of(spec: TokenizerSpec) -> Tokenizer:
    return build_tokenizer(
        spec.tokenizer_type,
        spec.tokenizer_model,
        spec.vocab_file,
        spec.merge_file,
        spec.vocab_size,
        spec.null_tokenizer_eod,
    )
