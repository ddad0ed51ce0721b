"""Megatron mmap indexed dataset: exact byte layout, round trips and errors on bad files."""

import os
import pickle
import struct

import numpy as np
import pytest

from megatron.data.indexed_dataset import (
    DTYPE_CODES,
    MMapIndexedDataset,
    MMapIndexedDatasetBuilder,
    best_fitting_dtype,
    dataset_exists,
)
from megatron.data.token_checksum import checksum_path
from megatron.errors import DataError

# Three documents; the second has two sequences (as a sentence-split corpus would).
DOCUMENTS = [[[5, 6, 7]], [[1], [2, 3, 4, 9]], [[8, 8]]]


def write_dataset(prefix, documents=DOCUMENTS, dtype=np.uint16, checksum=False):
    """PREFIX.bin/.idx as the builder writes them; without `checksum`, its PREFIX.checksum.json is
    removed, as data preprocessed before checksums were recorded has none, so that the checks of
    the files themselves (test_data_integrity.py) are tested alone."""
    builder = MMapIndexedDatasetBuilder(f"{prefix}.bin", dtype)
    for document in documents:
        for sequence in document:
            builder.add_item(sequence)
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    if not checksum:
        os.remove(checksum_path(str(prefix)))
    return str(prefix)


def test_round_trip(tmp_path):
    dataset = MMapIndexedDataset(write_dataset(tmp_path / "d"))
    assert len(dataset) == 4
    assert dataset.dtype == np.uint16
    assert dataset.sizes.dtype == np.int32 and dataset.sizes.tolist() == [3, 1, 4, 2]
    assert dataset.doc_idx.tolist() == [0, 1, 3, 4]
    assert dataset[2].tolist() == [2, 3, 4, 9]
    assert dataset.get(2, offset=1, length=2).tolist() == [3, 4]
    assert dataset.get(2, offset=3).tolist() == [9]
    assert dataset[-1].tolist() == [8, 8]
    with pytest.raises(IndexError):
        dataset.get(0, offset=2, length=2)
    assert pickle.loads(pickle.dumps(dataset))[3].tolist() == [8, 8]


@pytest.mark.parametrize("code", sorted(DTYPE_CODES))
def test_every_dtype_code_round_trips(tmp_path, code):
    dtype = DTYPE_CODES[code]
    dataset = MMapIndexedDataset(write_dataset(tmp_path / "d", dtype=dtype))
    assert dataset.dtype == dtype
    assert (tmp_path / "d.idx").read_bytes()[17] == code
    assert dataset[3].dtype == dtype and dataset[3].tolist() == [8, 8]


def test_byte_layout_matches_megatron(tmp_path):
    write_dataset(tmp_path / "d", dtype=np.int32)
    sizes, pointers, doc_idx = [3, 1, 4, 2], [0, 12, 16, 32], [0, 1, 3, 4]
    expected = (
        b"MMIDIDX\x00\x00"
        + struct.pack("<Q", 1)
        + struct.pack("<B", 4)
        + struct.pack("<Q", len(sizes))
        + struct.pack("<Q", len(doc_idx))
        + struct.pack(f"<{len(sizes)}i", *sizes)
        + struct.pack(f"<{len(pointers)}q", *pointers)
        + struct.pack(f"<{len(doc_idx)}q", *doc_idx)
    )
    assert (tmp_path / "d.idx").read_bytes() == expected
    tokens = [t for document in DOCUMENTS for sequence in document for t in sequence]
    assert (tmp_path / "d.bin").read_bytes() == struct.pack(f"<{len(tokens)}i", *tokens)


def test_best_fitting_dtype():
    assert best_fitting_dtype(50257) == np.uint16
    assert best_fitting_dtype(65499) == np.uint16
    assert best_fitting_dtype(65500) == np.int32
    assert best_fitting_dtype(128256) == np.int32


def test_dataset_exists(tmp_path):
    assert not dataset_exists(str(tmp_path / "d"))
    assert dataset_exists(write_dataset(tmp_path / "d"))


def test_vocab_too_large_for_dtype(tmp_path):
    with pytest.raises(DataError, match="70000.*uint16.*use int32") as error:
        MMapIndexedDatasetBuilder(str(tmp_path / "d.bin"), np.uint16, vocab_size=70000)
    assert "d.bin" in str(error.value)
    MMapIndexedDatasetBuilder(str(tmp_path / "e.bin"), np.int32, vocab_size=70000).finalize(str(tmp_path / "e.idx"))


def test_failed_build_leaves_no_files(tmp_path):
    with pytest.raises(RuntimeError), MMapIndexedDatasetBuilder(str(tmp_path / "d.bin"), np.uint16) as builder:
        builder.add_item([1, 2])
        raise RuntimeError("tokenizer crashed")
    assert os.listdir(tmp_path) == []


def test_missing_files(tmp_path):
    prefix = str(tmp_path / "nothing")
    with pytest.raises(DataError, match="nothing.idx and .*nothing.bin.*preprocess_data.py"):
        MMapIndexedDataset(prefix)
    write_dataset(tmp_path / "d")
    os.remove(tmp_path / "d.bin")
    with pytest.raises(DataError, match="d.bin"):
        MMapIndexedDataset(str(tmp_path / "d"))


# (data sets written, the prefix passed, the error's end); {t} is tmp_path
WRONG_PREFIXES = {
    "a .bin file": (["c_text_document"], "c_text_document.bin", "pass the prefix '{t}/c_text_document' instead."),
    "an .idx file": (["c_text_document"], "c_text_document.idx", "pass the prefix '{t}/c_text_document' instead."),
    "the --output-prefix": (
        ["c_text_document", "c_title_document"],
        "c",
        "pass the prefix '{t}/c_text_document' instead.",
    ),
    "the --output-prefix of other keys": (
        ["c_body_document", "c_title_document"],
        "c",
        "but '{t}/c_body_document', '{t}/c_title_document' beside it have their .bin and .idx "
        "(one per --json-keys key of tools/preprocess_data.py); pass one of those prefixes instead.",
    ),
}


@pytest.mark.parametrize("written, passed, ending", WRONG_PREFIXES.values(), ids=WRONG_PREFIXES)
def test_a_wrong_prefix_names_the_data_set_beside_it(tmp_path, written, passed, ending):
    """--data-path x_text_document.bin asked for x_text_document.bin.bin; a bare --output-prefix
    did not point at OUTPUT_PREFIX_text_document (issue 29)."""
    for name in written:
        write_dataset(tmp_path / name)
    with pytest.raises(DataError) as error:
        MMapIndexedDataset(str(tmp_path / passed))
    message = str(error.value)
    assert message.startswith(f"no indexed dataset at prefix '{tmp_path / passed}'"), message
    assert message.endswith(ending.format(t=tmp_path)), message
    assert ".bin.bin" not in message, message


@pytest.mark.parametrize("removed", ["bin", "idx"])
def test_a_file_path_of_a_half_data_set_names_the_missing_half(tmp_path, removed):
    write_dataset(tmp_path / "d")
    os.remove(tmp_path / f"d.{removed}")
    kept = "idx" if removed == "bin" else "bin"
    with pytest.raises(DataError) as error:
        MMapIndexedDataset(str(tmp_path / f"d.{kept}"))
    assert str(error.value) == (
        f"no indexed dataset at prefix '{tmp_path}/d.{kept}' (a data path is the prefix without .{kept}): "
        f"{tmp_path}/d.{removed} is missing beside {tmp_path}/d.{kept}; produce both with tools/preprocess_data.py."
    )


def corrupt(path, transform):
    path.write_bytes(transform(path.read_bytes()))


@pytest.mark.parametrize(
    "file, transform, message",
    [
        ("d.idx", lambda b: b"NOTANIDX!" + b[9:], r"d\.idx is not a Megatron mmap index"),
        ("d.idx", lambda b: b[:20], r"d\.idx is truncated inside its header"),
        ("d.idx", lambda b: b[:-8], r"d\.idx is truncated: .*4 sequences and 4 document entries"),
        ("d.idx", lambda b: b[:9] + struct.pack("<Q", 2) + b[17:], r"d\.idx has index version 2"),
        ("d.idx", lambda b: b[:17] + b"\x09" + b[18:], r"d\.idx declares unknown dtype code 9"),
        ("d.bin", lambda b: b + b"\x00\x00", r"d\.bin has 22 bytes but .*d\.idx describes 20"),
        ("d.bin", lambda b: b[:-2], r"d\.bin has 18 bytes"),
    ],
)
def test_corrupt_files(tmp_path, file, transform, message):
    write_dataset(tmp_path / "d")
    corrupt(tmp_path / file, transform)
    with pytest.raises(DataError, match=message):
        MMapIndexedDataset(str(tmp_path / "d"))


def test_empty_dataset(tmp_path):
    write_dataset(tmp_path / "d", documents=[])
    with pytest.raises(DataError, match=r"d\.idx holds zero sequences"):
        MMapIndexedDataset(str(tmp_path / "d"))
