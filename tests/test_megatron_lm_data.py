"""Megatron-LM's data conventions (issue 18): empty rows, --split boundaries, NullTokenizer's eod.

The expected values come from independent transcriptions of Megatron-LM's code in this file
(its tools/preprocess_data.py with IndexedDatasetBuilder and the documented .idx layout,
megatron.core's split arithmetic, the legacy split of Megatron-DeepSpeed), never from our writer.
"""

import functools
import json
import re
import struct
from pathlib import Path

import numpy as np
import pytest

from megatron.checkpoint.format1 import tokenizer_from_flags
from megatron.cli import preprocess_data
from megatron.data import preprocess
from megatron.data.gpt_dataset import (
    SPLIT_CUMULATIVE,
    SPLIT_LEGACY,
    GPTDataset,
    build_train_valid_test_datasets,
    get_train_valid_test_split,
)
from megatron.data.indexed_dataset import MMapIndexedDataset, MMapIndexedDatasetBuilder
from megatron.data.preprocess import TokenizerSpec
from megatron.errors import ConfigError, DataError
from megatron.inference.checkpoint_model import tokenizer_from_spec
from tests.test_gpt_dataset import megatron_sample_idx
from tests.training_fixtures import tiny_config

# Empty rows first, last, in a run, and text that is only spaces (no ids for the NullTokenizer).
ROWS = ["", "1 2 3", "", "", "4", "   ", "5 6 7 8", ""]
UINT16_CODE = 8  # Megatron's DType code of the token dtype for a vocabulary under 65500


def megatron_preprocessed(texts: list[str], eod: int, append_eod: bool) -> tuple[bytes, bytes]:
    """The .bin and .idx bytes Megatron-LM's tools/preprocess_data.py writes for these rows.

    Encoder.encode keeps one sentence per row and appends the EOD only to a document with ids;
    IndexedDatasetBuilder.add_document(ids, lengths) then extends the sequence lengths by
    `lengths` (nothing for an empty row) and appends len(sequence lengths) to the document index.
    The .idx is laid out as documented: magic, version <Q 1, dtype code <B, sequence count <Q,
    document index count <Q, int32 lengths, int64 byte pointers, int64 document index.
    """
    tokens: list[int] = []
    lengths: list[int] = []
    document_index = [0]
    for text in texts:
        ids = [int(word) for word in text.split()]
        sentence_lengths = [len(ids)] if ids else []
        if ids and append_eod:
            ids.append(eod)
            sentence_lengths[-1] += 1
        tokens += ids
        lengths += sentence_lengths
        document_index.append(len(lengths))
    pointers, byte = [], 0
    for length in lengths:
        pointers.append(byte)
        byte += 2 * length  # uint16
    idx = (
        b"MMIDIDX\x00\x00"
        + struct.pack("<Q", 1)
        + struct.pack("<B", UINT16_CODE)
        + struct.pack("<Q", len(lengths))
        + struct.pack("<Q", len(document_index))
        + struct.pack(f"<{len(lengths)}i", *lengths)
        + struct.pack(f"<{len(pointers)}q", *pointers)
        + struct.pack(f"<{len(document_index)}q", *document_index)
    )
    return struct.pack(f"<{len(tokens)}H", *tokens), idx


def write_jsonl(path, texts: list[str]) -> str:
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    return str(path)


@pytest.mark.parametrize("append_eod", [False, True], ids=["no eod", "append eod"])
def test_empty_rows_are_written_byte_for_byte_as_megatron_lm_writes_them(tmp_path, append_eod):
    source = write_jsonl(tmp_path / "corpus.jsonl", ROWS)
    spec = TokenizerSpec("NullTokenizer", vocab_size=20)
    [prefix] = preprocess.preprocess(source, str(tmp_path / "c"), spec, ["text"], append_eod=append_eod, workers=2)
    expected_bin, expected_idx = megatron_preprocessed(ROWS, eod=19, append_eod=append_eod)
    assert Path(f"{prefix}.bin").read_bytes() == expected_bin
    assert Path(f"{prefix}.idx").read_bytes() == expected_idx
    dataset = MMapIndexedDataset(prefix)  # and our reader takes documents without sequences
    assert dataset.doc_idx.tolist() == [0, 0, 1, 1, 1, 2, 2, 3, 3]


def test_the_extra_eod_convention_is_written_as_megatron_deepspeed_writes_it(tmp_path):
    source = write_jsonl(tmp_path / "corpus.jsonl", ROWS)
    flags = [
        "--input",
        source,
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "20",
        "--append-eod",
        "--null-tokenizer-eod",
        "extra",
        "--output-prefix",
        str(tmp_path / "c"),
    ]
    preprocess_data.main(flags)
    expected_bin, expected_idx = megatron_preprocessed(ROWS, eod=20, append_eod=True)
    assert (tmp_path / "c_text_document.bin").read_bytes() == expected_bin
    assert (tmp_path / "c_text_document.idx").read_bytes() == expected_idx


def test_empty_rows_move_no_split_boundary_and_no_sample(tmp_path):
    rows = [" ".join(str(t % 19) for t in range(i, i + 3 + i % 5)) for i in range(40)]
    with_empty = [text for row in rows for text in (row, "", "")]
    spec = TokenizerSpec("NullTokenizer", vocab_size=20)
    built = []
    for name, texts in (("plain", rows), ("empty", with_empty)):
        [prefix] = preprocess.preprocess(
            write_jsonl(tmp_path / f"{name}.jsonl", texts), str(tmp_path / name), spec, ["text"], append_eod=True
        )
        built.append(build_train_valid_test_datasets([prefix], "8,1,1", (30, 5, 5), 6, 1, vocab_size=20))
    for plain, empty in zip(*built):
        for kind in ("doc_idx", "sample_idx", "shuffle_idx"):
            np.testing.assert_array_equal(getattr(plain, kind), getattr(empty, kind))
        assert [plain[i]["text"].tolist() for i in range(len(plain))] == [
            empty[i]["text"].tolist() for i in range(len(empty))
        ]
        expected = megatron_sample_idx(empty.indexed_dataset.sizes, empty.doc_idx, 6, len(empty))
        np.testing.assert_array_equal(empty.sample_idx, expected)


def test_a_bad_token_names_its_document_past_empty_documents(tmp_path):
    builder = MMapIndexedDatasetBuilder(str(tmp_path / "d.bin"), np.uint16)
    for document in ([1, 2], [], [], [3, 99], []):
        builder.add_document(np.array(document))
    builder.finalize(str(tmp_path / "d.idx"))
    indexed = MMapIndexedDataset(str(tmp_path / "d"))
    assert indexed.doc_idx.tolist() == [0, 1, 1, 1, 2, 2]
    dataset = GPTDataset("train", indexed, np.arange(2, dtype=np.int32), 1, 3, seed=1, vocab_size=50)
    with pytest.raises(DataError, match=r"document 3 \(sequence 1\) holds token id 99"):
        dataset[0]


def megatron_core_split(split: str, num_sequences: int) -> list[list[int]]:
    """Each split's sequences as current Megatron-LM picks them, transcribed: parse_and_normalize_split,
    convert_split_vector_to_split_matrix and the GPT builder's rounding over the sequence count
    (a split with no share is None there, no sequences here)."""
    vector = [float(x) for x in re.findall(r"[.0-9]+", split)]
    vector = vector + [0.0 for _ in range(3 - len(vector))]
    weights = np.array(vector, dtype=np.float64)
    vector = (weights / np.sum(weights)).tolist()
    expansion = functools.reduce(lambda a, b: a + [a[len(a) - 1] + b], [[0], *vector])
    ranges = []
    for begin, end in zip(expansion[:-1], expansion[1:]):
        if end <= begin:
            ranges.append([])
        else:
            ranges.append(list(range(int(round(begin * float(num_sequences))), int(round(end * float(num_sequences))))))
    return ranges


def legacy_split(splits_string: str, size: int) -> list[int]:
    """Megatron-DeepSpeed's get_train_valid_test_split_, transcribed (its --split over sequences)."""
    if splits_string.find(",") != -1:
        splits = [float(s) for s in splits_string.split(",")]
    elif splits_string.find("/") != -1:
        splits = [float(s) for s in splits_string.split("/")]
    else:
        splits = [float(splits_string)]
    while len(splits) < 3:
        splits.append(0.0)
    splits = splits[:3]
    splits_sum = sum(splits)
    splits = [split / splits_sum for split in splits]
    splits_index = [0]
    for index, split in enumerate(splits):
        splits_index.append(splits_index[index] + int(round(split * float(size))))
    diff = splits_index[-1] - size
    for index in range(1, len(splits_index)):
        splits_index[index] -= diff
    return splits_index


SPLIT_TABLE = [
    ("969,30,1", 1000),
    ("969,30,1", 10_000),
    ("969,30,1", 137),
    ("969,30,1", 50),
    ("949,50,1", 2000),
    ("98,2,0", 50),
    ("98/2", 10),
    ("99,1", 150),
    ("1,1,1", 10),
    ("1,1,1", 100),
    ("1,1,1", 7),
    ("80,20", 2),
    ("80,10,10", 33),
    ("90,5,5", 21),
    ("1,1", 5),
    ("1,2,1", 6),
    ("0.5,0.25,0.25", 7),
    ("3,1,1", 12),
    ("1,0,1", 5),
    ("7,2,1", 15),
    ("70,20,10", 1),
]


@pytest.mark.parametrize("split, size", SPLIT_TABLE)
def test_cumulative_split_is_current_megatron_lms(split, size):
    bounds = get_train_valid_test_split(split, size, SPLIT_CUMULATIVE)
    assert [list(range(a, b)) for a, b in zip(bounds, bounds[1:])] == megatron_core_split(split, size)


@pytest.mark.parametrize("split, size", SPLIT_TABLE)
def test_legacy_split_is_megatron_deepspeeds(split, size):
    assert get_train_valid_test_split(split, size, SPLIT_LEGACY) == legacy_split(split, size)


def test_the_two_roundings_differ_where_rounding_lands_differently():
    differ = [
        (split, size)
        for split, size in SPLIT_TABLE
        if get_train_valid_test_split(split, size, SPLIT_CUMULATIVE) != legacy_split(split, size)
    ]
    # Worked by hand: halves of 5 end at 2.5, which rounds half to even, to 2 (cumulative); the
    # legacy way rounds each half to 2, falls one short of 5 and shifts the boundary to 3.
    assert get_train_valid_test_split("1,1", 5) == [0, 2, 5, 5]
    assert get_train_valid_test_split("1,1", 5, SPLIT_LEGACY) == [0, 3, 5, 5]
    assert differ == [
        ("1,1,1", 10),
        ("1,1,1", 100),
        ("1,1,1", 7),
        ("80,10,10", 33),
        ("1,1", 5),
        ("1,2,1", 6),
        ("0.5,0.25,0.25", 7),
        ("3,1,1", 12),
        ("1,0,1", 5),
    ]


def test_a_split_counts_sequences_not_documents(tmp_path):
    # Ten documents of two sequences each (a sentence-split corpus): thirds of 20 sequences.
    builder = MMapIndexedDatasetBuilder(str(tmp_path / "d.bin"), np.uint16)
    for document in range(10):
        builder.add_item(np.full(4, document))
        builder.add_item(np.full(3, document))
        builder.end_document()
    builder.finalize(str(tmp_path / "d.idx"))
    # Cumulative: 6.67 and 13.33 round to 7 and 13; legacy: three rounded 7s overshoot by one, shifted.
    for rounding, first_valid in ((SPLIT_CUMULATIVE, 7), (SPLIT_LEGACY, 6)):
        train, valid, _ = build_train_valid_test_datasets(
            [str(tmp_path / "d")], "1,1,1", (5, 5, 5), 4, 1, split_rounding=rounding
        )
        assert sorted(set(train.doc_idx.tolist())) == list(range(first_valid))
        assert sorted(set(valid.doc_idx.tolist())) == list(range(first_valid, 13))


def test_pretrain_flags_default_to_current_megatron_lm(tmp_path):
    data = tiny_config(str(tmp_path / "unused")).data
    assert (data.split_rounding, data.null_tokenizer_eod) == ("cumulative", "last")
    data = tiny_config(str(tmp_path / "unused"), split_rounding="legacy", null_tokenizer_eod="extra").data
    assert (data.split_rounding, data.null_tokenizer_eod) == ("legacy", "extra")
    with pytest.raises(ConfigError, match="--split-rounding"):
        tiny_config(str(tmp_path / "unused"), split_rounding="nearest")


def test_checkpoints_saved_before_the_flag_keep_the_extra_eod():
    old = tokenizer_from_spec(tokenizer_from_flags({"tokenizer_type": "NullTokenizer", "vocab_size": 60}))
    assert (old.vocab_size, old.eod) == (61, 60)
    new = tokenizer_from_spec(
        tokenizer_from_flags({"tokenizer_type": "NullTokenizer", "vocab_size": 60, "null_tokenizer_eod": "last"})
    )
    assert (new.vocab_size, new.eod) == (60, 59)
