"""Tokenizers: SentencePiece (trained here), hand-written GPT-2 byte-level BPE, Null; padding."""

import json
import random

import pytest
import sentencepiece

from megatron.cli import train_tokenizer
from megatron.data.tokenizer import (
    _PRETOKENIZE,
    GPT2BPETokenizer,
    SentencePieceTokenizer,
    _bytes_to_unicode,
    build_tokenizer,
    padded_vocab_size,
)
from megatron.errors import ConfigError, DataError
from megatron.inference.checkpoint_model import with_moved_files
from megatron.tokenizer_spec import TokenizerSpec

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog",
    "data",
    "model",
    "token",
    "train",
    "expert",
    "layer",
]


def write_corpus(path, lines=400, seed=0):
    rng = random.Random(seed)
    path.write_text("\n".join(" ".join(rng.choice(WORDS) for _ in range(12)) + f" {i}" for i in range(lines)) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def sentencepiece_model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("sp")
    corpus = write_corpus(directory / "corpus.txt")
    train_tokenizer.main(["--input", corpus, "--vocab-size", "320", "--model-prefix", str(directory / "sp")])
    return str(directory / "sp.model")


def test_sentencepiece_round_trip(sentencepiece_model):
    tokenizer = build_tokenizer("SentencePieceTokenizer", tokenizer_model=sentencepiece_model)
    assert tokenizer.vocab_size == 320
    assert tokenizer.eod == 2
    text = "the lazy expert trains a model 42"
    ids = tokenizer.tokenize(text)
    assert all(isinstance(i, int) for i in ids)
    assert tokenizer.detokenize(ids) == text
    assert tokenizer.detokenize(tokenizer.tokenize("zébra ☃")) == "zébra ☃"  # byte fallback


def test_sentencepiece_without_eos(tmp_path):
    corpus = write_corpus(tmp_path / "corpus.txt", lines=50)
    sentencepiece.SentencePieceTrainer.train(
        input=corpus, model_prefix=str(tmp_path / "m"), vocab_size=40, eos_id=-1, minloglevel=2
    )
    with pytest.raises(DataError, match=r"m\.model has no end-of-sentence token"):
        SentencePieceTokenizer(str(tmp_path / "m.model"))


def test_sentencepiece_bad_model_file(tmp_path):
    (tmp_path / "x.model").write_text("not a model")
    with pytest.raises(DataError, match=r"x\.model is not a SentencePiece model"):
        SentencePieceTokenizer(str(tmp_path / "x.model"))


def test_byte_table_is_gpt2s():
    table = _bytes_to_unicode()
    assert len(set(table.values())) == 256
    assert table[ord("A")] == "A" and table[ord("é".encode("latin-1"))] == "é"
    assert table[ord(" ")] == "Ġ" and table[ord("\n")] == "Ċ" and table[0] == "Ā"


def test_pretokenizer_splits_like_gpt2():
    assert _PRETOKENIZE.findall("Hello world's 123!!  x_y\n") == [
        "Hello",
        " world",
        "'s",
        " 123",
        "!!",
        " ",
        " x",
        "_",
        "y",
        "\n",
    ]


MERGES = ["t h", "Ġ th", "Ġth e", "Ã ©", "c a", "ca f", "caf Ã©"]


@pytest.fixture
def gpt2_files(tmp_path):
    pieces = list(_bytes_to_unicode().values()) + [m.replace(" ", "") for m in MERGES] + ["<|endoftext|>"]
    vocab = {piece: i for i, piece in enumerate(pieces)}
    (tmp_path / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    (tmp_path / "merges.txt").write_text("#version: 0.2\n" + "\n".join(MERGES) + "\n", encoding="utf-8")
    return str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"), vocab


def test_gpt2_bpe_merges_and_round_trip(gpt2_files):
    vocab_file, merge_file, vocab = gpt2_files
    tokenizer = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab_file, merge_file=merge_file)
    assert tokenizer.vocab_size == len(vocab)
    assert tokenizer.eod == vocab["<|endoftext|>"]
    assert tokenizer.tokenize(" the") == [vocab["Ġthe"]]
    assert tokenizer.tokenize("café") == [vocab["cafÃ©"]]
    assert tokenizer.tokenize("the") == [vocab["th"], vocab["e"]]
    text = "the café  déjà vu\n\tπ≈3.14 ²_x <|endoftext|> 🙂 日本語"
    assert tokenizer.detokenize(tokenizer.tokenize(text)) == text


def test_gpt2_bpe_bad_files(gpt2_files, tmp_path):
    vocab_file, merge_file, vocab = gpt2_files
    del vocab["<|endoftext|>"]
    (tmp_path / "no_eod.json").write_text(json.dumps(vocab))
    with pytest.raises(DataError, match=r"no_eod\.json has no <\|endoftext\|>"):
        GPT2BPETokenizer(str(tmp_path / "no_eod.json"), merge_file)
    (tmp_path / "small.json").write_text(json.dumps({"a": 0, "<|endoftext|>": 1}))
    with pytest.raises(DataError, match=r"small\.json lacks 255 of the 256 byte pieces"):
        GPT2BPETokenizer(str(tmp_path / "small.json"), merge_file)
    (tmp_path / "other_merges.txt").write_text("q u\n")
    with pytest.raises(DataError, match="must come from the same tokenizer"):
        GPT2BPETokenizer(vocab_file, str(tmp_path / "other_merges.txt")).tokenize("quiz")


def test_null_tokenizer():
    tokenizer = build_tokenizer("NullTokenizer", vocab_size=100)
    assert tokenizer.tokenize("1 2  3\n99") == [1, 2, 3, 99]
    assert tokenizer.detokenize([4, 5]) == "4 5"
    with pytest.raises(DataError, match="space-separated integer ids"):
        tokenizer.tokenize("hello world")
    with pytest.raises(DataError, match="id 100 is outside 0..99"):
        tokenizer.tokenize("3 100")


@pytest.mark.parametrize(
    "convention, vocab_size, eod",
    [
        pytest.param("last", 100, 99, id="current Megatron-LM: the last of --vocab-size ids (the default)"),
        pytest.param("extra", 101, 100, id="Megatron-DeepSpeed: one extra id, --vocab-size itself"),
    ],
)
def test_null_tokenizer_eod_conventions(convention, vocab_size, eod):
    tokenizer = build_tokenizer("NullTokenizer", vocab_size=100, null_tokenizer_eod=convention)
    assert (tokenizer.vocab_size, tokenizer.eod) == (vocab_size, eod)
    assert tokenizer.tokenize(f"0 {eod}") == [0, eod]
    # The conventions are one tokenizer for --vocab-size values one apart: old data reads either way.
    other = build_tokenizer("NullTokenizer", vocab_size=vocab_size, null_tokenizer_eod="last")
    assert (other.vocab_size, other.eod) == (vocab_size, eod)


def test_padded_vocab_size():
    assert padded_vocab_size(50257) == 50304
    assert padded_vocab_size(128) == 128
    assert padded_vocab_size(101, divisible_by=8) == 104
    with pytest.raises(ConfigError):
        padded_vocab_size(100, divisible_by=0)


@pytest.mark.parametrize(
    "kwargs, error, flag",
    [
        ({"tokenizer_type": "SentencePieceTokenizer"}, ConfigError, "--tokenizer-model"),
        (
            {"tokenizer_type": "SentencePieceTokenizer", "tokenizer_model": "/no/such.model"},
            DataError,
            "--tokenizer-model /no/such.model",
        ),
        ({"tokenizer_type": "GPT2BPETokenizer", "merge_file": "m.txt"}, ConfigError, "--vocab-file"),
        ({"tokenizer_type": "GPT2BPETokenizer", "vocab_file": "v.json"}, ConfigError, "--merge-file"),
        ({"tokenizer_type": "NullTokenizer"}, ConfigError, "--vocab-size"),
        (
            {"tokenizer_type": "NullTokenizer", "vocab_size": 9, "null_tokenizer_eod": "first"},
            ConfigError,
            "--null-tokenizer-eod 'first'",
        ),
        ({"tokenizer_type": "BertTokenizer"}, ConfigError, "--tokenizer-type 'BertTokenizer'"),
    ],
)
def test_build_tokenizer_names_the_missing_flag(kwargs, error, flag):
    with pytest.raises(error, match=flag):
        build_tokenizer(**kwargs)


def test_moved_tokenizer_files_replace_only_the_paths_given():
    saved = TokenizerSpec("GPT2BPETokenizer", vocab_file="/old/vocab.json", merge_file="/old/merges.txt")
    moved = with_moved_files(saved, {"vocab_file": "/new/vocab.json", "merge_file": None, "tokenizer_model": None})
    assert moved == TokenizerSpec("GPT2BPETokenizer", vocab_file="/new/vocab.json", merge_file="/old/merges.txt")
    assert with_moved_files(saved, None) == saved
