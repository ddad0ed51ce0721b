"""Tokenizers both ways, checked to give the same ids (tokenizer_check.py).

Export: a SentencePiece model goes as tokenizer.model plus the tokenizer.json that transformers
builds from the model's own settings (its normalizer, dummy prefix, byte fallback), loaded as
PreTrainedTokenizerFast: transformers' LlamaTokenizer would apply Llama's whitespace rules instead
of the model's. Its decoder then renders the unknown piece as SentencePiece does, and
`split_special_tokens` keeps "</s>" in text as text, as SentencePiece does. GPT-2's BPE goes as
vocab.json and merges.txt for GPT2Tokenizer. The NullTokenizer (text is space-separated ids)
goes as a word-level tokenizer.json that maps "17" to 17. Neither side adds a BOS or EOS token by
itself, as ours does not.

Import: tokenizer.model becomes our SentencePieceTokenizer, vocab.json + merges.txt our
GPT2BPETokenizer (both copied next to the checkpoint), the word-level ids of an exported
NullTokenizer a NullTokenizer again; any other tokenizer has no equivalent here,
so the checkpoint gets a NullTokenizer over the model's vocabulary (pre-tokenized data, ids as
text). A difference from the Hugging Face tokenizer on the probe texts is reported.
"""

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron.data.tokenizer import GPT2BPETokenizer, NullTokenizer, SentencePieceTokenizer, Tokenizer
from megatron.errors import CheckpointError, DataError
from megatron.hf.tokenizer_check import compare, probe_texts, require_transformers
from megatron.tokenizer_spec import TokenizerSpec

GPT2_END = "<|endoftext|>"
# Unicode's noncharacters, reserved for a program's internal use (render_unknown_as_sentencepiece)
NONCHARACTERS = tuple(map(chr, range(0xFDD0, 0xFDF0)))


def _write_json(path: Path, content: dict[str, Any]) -> None:
    path.write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n")


def render_unknown_as_sentencepiece(path: Path, sp: Any) -> None:
    """Make the tokenizer.json at `path` decode the unknown id of `sp` (a SentencePieceProcessor)
    as SentencePiece does (its unk_surface, " ⁇ ") instead of as the piece ("<unk>"). The piece
    first becomes a noncharacter that no piece holds, which becomes the surface once the rest of
    the decoder has run: the rest strips the dummy prefix's space from the text's start, and must
    not take the surface's own (SentencePiece keeps it). A decoder that cannot be extended so is
    left as it is, and the check reports the rendering."""
    content = json.loads(path.read_text())
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    stand_in = next((c for c in NONCHARACTERS if not any(c in piece for piece in pieces)), None)
    decoder = content.get("decoder")
    if decoder is None or stand_in is None:
        return
    unknown = sp.id_to_piece(sp.unk_id())
    content["decoder"] = {
        "type": "Sequence",
        "decoders": [
            {"type": "Replace", "pattern": {"Regex": rf"\A{re.escape(unknown)}\z"}, "content": stand_in},
            *(decoder["decoders"] if decoder["type"] == "Sequence" else [decoder]),
            {"type": "Replace", "pattern": {"String": stand_in}, "content": sp.decode([sp.unk_id()])},
        ],
    }
    _write_json(path, content)


def export_tokenizer(
    kind: str, files: dict[str, str | None], ours: Tokenizer, out: Path, max_length: int
) -> dict[str, int | None]:
    """Write `ours` (of --tokenizer-type `kind`, from `files`) into `out` for AutoTokenizer; returns
    the special token ids for config.json."""
    common = {
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "add_eos_token": False,
    }
    if kind == "SentencePieceTokenizer":
        import sentencepiece

        shutil.copyfile(files["tokenizer_model"], out / "tokenizer.model")
        sp = sentencepiece.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))
        specials = {
            f"{name}_token": sp.id_to_piece(i)
            for name, i in (("bos", sp.bos_id()), ("eos", sp.eos_id()), ("unk", sp.unk_id()))
            if i >= 0
        }
        _write_json(
            out / "tokenizer_config.json",
            {"tokenizer_class": "PreTrainedTokenizerFast", **specials, "split_special_tokens": True, **common},
        )
        transformers = require_transformers("exporting a SentencePiece tokenizer")
        try:  # transformers 5 builds tokenizer.json from the model's own settings
            built = transformers.AutoTokenizer.from_pretrained(str(out))
            built.backend_tokenizer.save(str(out / "tokenizer.json"))
        except (ValueError, OSError, AttributeError) as error:
            raise CheckpointError(
                f"transformers {transformers.__version__} cannot build tokenizer.json from a "
                f"SentencePiece model ({error}); pip install -U 'transformers>=5'"
            ) from None
        render_unknown_as_sentencepiece(out / "tokenizer.json", sp)
        return {"bos_token_id": sp.bos_id() if sp.bos_id() >= 0 else None, "eos_token_id": ours.eod}
    if kind == "GPT2BPETokenizer":
        shutil.copyfile(files["vocab_file"], out / "vocab.json")
        shutil.copyfile(files["merge_file"], out / "merges.txt")
        _write_json(
            out / "tokenizer_config.json",
            {
                "tokenizer_class": "GPT2Tokenizer",
                "bos_token": GPT2_END,
                "eos_token": GPT2_END,
                "unk_token": GPT2_END,
                "add_prefix_space": False,
                "errors": "replace",
                **common,
            },
        )
        return {"bos_token_id": ours.eod, "eos_token_id": ours.eod}
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers

    backend = Backend(models.WordLevel({str(i): i for i in range(ours.vocab_size)}, unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.save(str(out / "tokenizer.json"))
    _write_json(
        out / "tokenizer_config.json",
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": str(ours.eod), **common},
    )
    return {"bos_token_id": None, "eos_token_id": ours.eod}


def exported_tokenizer_bytes(kind: str, files: dict[str, str | None], ours: Tokenizer) -> int:
    """About as many bytes as `export_tokenizer` writes, generously, but for tokenizer_config.json:
    the files it copies, and the tokenizer.json it builds, which is a few times the SentencePiece
    model (its precompiled normalizer and pieces as JSON) or some 22 bytes an id (NullTokenizer)."""
    if kind == "SentencePieceTokenizer":
        return 5 * Path(files["tokenizer_model"]).stat().st_size
    if kind == "GPT2BPETokenizer":
        return sum(Path(files[name]).stat().st_size for name in ("vocab_file", "merge_file"))
    return 32 * ours.vocab_size


def null_tokenizer_size(hf_dir: Path) -> int | None:
    """The id count of a tokenizer.json that is a NullTokenizer as `export_tokenizer` writes it
    ("0" -> 0, ..., end of document the last id), else None."""
    path = hf_dir / "tokenizer.json"
    if not path.is_file() or path.stat().st_size > 64 << 20:
        return None
    model = json.loads(path.read_text()).get("model") or {}
    vocab = model.get("vocab")
    if (
        model.get("type") != "WordLevel"
        or not isinstance(vocab, dict)
        or vocab != {str(i): i for i in range(len(vocab))}
    ):
        return None
    return len(vocab)


@dataclass(frozen=True)
class ImportedTokenizer:
    spec: TokenizerSpec  # ours, naming the copies of `files` in the destination
    tokenizer: Tokenizer
    note: str | None  # what the user should know (no equivalent, or a difference)
    files: tuple[Path, ...] = ()  # of the Hugging Face folder, for copy_tokenizer_files

    @property
    def nbytes(self) -> int:
        return sum(path.stat().st_size for path in self.files)


def import_tokenizer(hf_dir: Path, dest: Path, model_vocab: int) -> ImportedTokenizer:
    """Our tokenizer for the Hugging Face folder `hf_dir`, read from its files; its spec names
    their copies in `dest`, which copy_tokenizer_files makes (nothing is written here)."""

    def copy_of(name: str) -> str:
        return str((dest / name).resolve())

    imported, problem = None, None
    try:
        if (hf_dir / "tokenizer.model").is_file():
            imported = (
                TokenizerSpec("SentencePieceTokenizer", tokenizer_model=copy_of("tokenizer.model")),
                SentencePieceTokenizer(str(hf_dir / "tokenizer.model")),
                (hf_dir / "tokenizer.model",),
            )
        elif (hf_dir / "vocab.json").is_file() and (hf_dir / "merges.txt").is_file():
            imported = (
                TokenizerSpec("GPT2BPETokenizer", vocab_file=copy_of("vocab.json"), merge_file=copy_of("merges.txt")),
                GPT2BPETokenizer(str(hf_dir / "vocab.json"), str(hf_dir / "merges.txt")),
                (hf_dir / "vocab.json", hf_dir / "merges.txt"),
            )
        elif (ids := null_tokenizer_size(hf_dir)) is not None:
            imported = (TokenizerSpec("NullTokenizer", vocab_size=ids), NullTokenizer(ids), ())
    except DataError as error:
        problem = f"its tokenizer files are not ones this toolkit reads ({error})"
    if imported is None:
        problem = problem or "it has no tokenizer.model (SentencePiece) nor vocab.json and merges.txt (GPT-2 BPE)"
        return ImportedTokenizer(
            TokenizerSpec("NullTokenizer", vocab_size=model_vocab),
            NullTokenizer(model_vocab),
            f"{hf_dir}: {problem}, so the checkpoint has a NullTokenizer over the model's {model_vocab} ids "
            f"(end of document {model_vocab - 1}): train it on data tokenized elsewhere, ids written as text",
        )
    spec, tokenizer, files = imported
    note = None
    if any((hf_dir / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        try:
            comparison = compare(tokenizer, hf_dir, probe_texts(tokenizer))
            difference, rendering = comparison.difference, comparison.unknown_rendering
        except Exception as error:  # a tokenizer transformers cannot load is not ours to judge
            difference, rendering = f"transformers could not load it to compare ({type(error).__name__}: {error})", None
        if difference:
            note = (
                f"{hf_dir}'s Hugging Face tokenizer and ours from the same files differ: {difference}; data "
                "tokenized by this toolkit follows ours"
            )
        elif rendering:
            note = (
                f"{hf_dir}'s Hugging Face tokenizer and ours from the same files give the same ids and text on the "
                f"probe texts but for the unknown piece, which it renders as {rendering}"
            )
    return ImportedTokenizer(spec, tokenizer, note, files)


def copy_tokenizer_files(imported: ImportedTokenizer, dest: Path) -> None:
    """Copy the files `imported` reads into `dest` (its spec names the copies where `dest` ends up)."""
    if imported.files:
        dest.mkdir(parents=True, exist_ok=True)
    for path in imported.files:
        shutil.copyfile(path, dest / path.name)
