"""The checksum file beside token data (issue 29): PREFIX.checksum.json, by fault injection.

Each fault is made on disk (a flipped bit, a truncated or appended file, data rewritten without the
checksum file) and the public API is asked to open the data: a changed .bin or .idx stops with a
DataError naming the file and the two ways on; data without a checksum file still loads, named in
one log line; --no-data-checksum (verify_checksum=False) skips the check.
"""

import json
import logging
import os
import pickle
from pathlib import Path

import numpy as np
import pytest

from megatron.data import preprocess
from megatron.data.gpt_dataset import build_train_valid_test_datasets
from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.data.token_checksum import checksum_path
from megatron.errors import DataError
from megatron.tokenizer_spec import TokenizerSpec
from tests.test_data_integrity import HEADER_BYTES, flip_bit
from tests.test_gpt_dataset import write_corpus
from tests.test_megatron_lm_data import ROWS, megatron_preprocessed, write_jsonl

# 12 documents of 300 int32 tokens: a 14,400-byte .bin, four 4 KiB checksum blocks (the last partial)
LENGTHS = [300] * 12
BIN_BYTES = 4 * sum(LENGTHS)
THE_FIX = "re-run tools/preprocess_data.py, or pass --no-data-checksum to use the data as it is."


def written(tmp_path: Path, name: str = "d") -> str:
    """A data set as the builder writes it: PREFIX.bin, PREFIX.idx and PREFIX.checksum.json."""
    write_corpus(tmp_path / name, LENGTHS)
    return str(tmp_path / name)


def assert_refused(prefix: str, damaged: str) -> None:
    with pytest.raises(DataError) as error:
        MMapIndexedDataset(prefix)
    message = str(error.value)
    assert message.startswith(f"{damaged} changed since preprocessing"), message
    assert checksum_path(prefix) in message and message.endswith(THE_FIX), message


def test_preprocessing_writes_the_checksum_file_beside_the_megatron_lm_files(tmp_path):
    [prefix] = preprocess.preprocess(
        write_jsonl(tmp_path / "corpus.jsonl", ROWS),
        str(tmp_path / "out" / "c"),
        TokenizerSpec("NullTokenizer", vocab_size=20),
        ["text"],
        append_eod=True,
    )
    assert sorted(os.listdir(tmp_path / "out")) == [f"c_text_document.{e}" for e in ("bin", "checksum.json", "idx")]
    # .bin and .idx byte for byte what Megatron-LM writes (as before the checksum file existed)
    assert (Path(f"{prefix}.bin").read_bytes(), Path(f"{prefix}.idx").read_bytes()) == megatron_preprocessed(
        ROWS, eod=19, append_eod=True
    )
    record = json.loads(Path(checksum_path(prefix)).read_text())
    assert record["format"] == 1 and record["algorithm"] == "block-sums-64"
    assert {role: entry["bytes"] for role, entry in record["files"].items()} == {
        "bin": os.path.getsize(f"{prefix}.bin"),
        "idx": os.path.getsize(f"{prefix}.idx"),
    }
    assert MMapIndexedDataset(prefix).checksum_verified


# first byte, a middle token's high bit, the last byte of a full 4 KiB block, the file's last byte
@pytest.mark.parametrize("position, bit", [(0, 0), (7_202, 7), (4_095, 3), (BIN_BYTES - 1, 6)])
def test_a_flipped_bit_in_the_tokens_stops_the_open(tmp_path, position, bit):
    prefix = written(tmp_path)
    flip_bit(f"{prefix}.bin", position, bit)
    assert_refused(prefix, f"{prefix}.bin")


def test_a_flipped_bit_in_the_index_that_its_own_checks_cannot_see_stops_the_open(tmp_path):
    """doc_idx [0, 1, 2, ...] with entry 2 flipped to 3 is still a valid index (it only moves a
    document boundary), so only the checksum can tell."""
    prefix = written(tmp_path)
    flip_bit(f"{prefix}.idx", HEADER_BYTES + 12 * len(LENGTHS) + 8 * 2, 0)
    assert MMapIndexedDataset(prefix, verify_checksum=False).doc_idx[:4].tolist() == [0, 1, 3, 3]
    assert_refused(prefix, f"{prefix}.idx")


@pytest.mark.parametrize(
    "file, change, message",
    [
        ("bin", lambda b: b[:-4], r"d\.bin has 14396 bytes but .*d\.idx describes 14400"),
        ("bin", lambda b: b + b"\x00" * 4, r"d\.bin has 14404 bytes"),
        ("idx", lambda b: b[:-8], r"d\.idx is truncated"),
        ("checksum.json", lambda b: b[:-20], r"d\.checksum\.json is not a checksum file this version reads"),
    ],
    ids=["truncated bin", "appended bin", "truncated idx", "truncated checksum file"],
)
def test_a_truncated_or_appended_file_stops_the_open_naming_it(tmp_path, file, change, message):
    prefix = written(tmp_path)
    path = Path(f"{prefix}.{file}")
    path.write_bytes(change(path.read_bytes()))
    with pytest.raises(DataError, match=message) as error:
        MMapIndexedDataset(prefix)
    assert "tools/preprocess_data.py" in str(error.value)


def test_data_rewritten_without_its_checksum_file_stops_the_open(tmp_path):
    """Another data set written over the prefix by a tool that keeps no checksum file (Megatron-LM's),
    the old checksum file left beside it: the .bin and .idx agree with each other, not with it."""
    prefix = written(tmp_path)
    old_checksums = Path(checksum_path(prefix)).read_bytes()
    write_corpus(tmp_path / "d", LENGTHS[:-1])
    Path(checksum_path(prefix)).write_bytes(old_checksums)
    assert_refused(prefix, f"{prefix}.idx")


def test_data_without_a_checksum_file_loads_with_one_line_naming_it(tmp_path, caplog):
    checked, unchecked = written(tmp_path, "checked"), written(tmp_path, "old")
    os.remove(checksum_path(unchecked))
    blend = ["0.5", checked, "0.5", unchecked, "0.5", f"{tmp_path}/./old"]  # "old" twice, spelled two ways
    with caplog.at_level(logging.WARNING, logger="megatron.data.gpt_dataset"):
        train, valid, _ = build_train_valid_test_datasets(blend, "9,1,0", (40, 4, 0), 16, 1)
    assert train is not None and valid is not None
    (line,) = [record.getMessage() for record in caplog.records]
    assert line.startswith("1 of 2 data sets have no PREFIX.checksum.json beside them"), line
    assert unchecked in line and checked + "," not in line and line.endswith("to record one"), line


def test_each_data_set_is_read_once_and_not_again_in_a_worker(tmp_path):
    """One open (and one check) serves every split; a worker's copy (pickled, as spawn sends it)
    does not read the files again: a bit flipped after the open goes unseen there."""
    prefix = written(tmp_path)
    train, valid, test = build_train_valid_test_datasets([prefix], "8,2,2", (20, 4, 4), 16, 1)
    assert train.indexed_dataset is valid.indexed_dataset is test.indexed_dataset
    assert train.indexed_dataset.checksum_verified
    flip_bit(f"{prefix}.bin", 100, 0)
    copy = pickle.loads(pickle.dumps(train))
    assert copy.indexed_dataset.checksum_verified and len(copy[0]["text"]) == 17


def test_verify_checksum_false_skips_the_check(tmp_path, caplog):
    prefix = written(tmp_path)
    flip_bit(f"{prefix}.bin", 100, 0)
    assert not MMapIndexedDataset(prefix, verify_checksum=False).checksum_verified
    with caplog.at_level(logging.WARNING, logger="megatron.data.gpt_dataset"):
        train, _, _ = build_train_valid_test_datasets([prefix], "1", (20, 0, 0), 16, 1, verify_checksum=False)
    assert train is not None and not caplog.records  # skipped on purpose: nothing to warn about


def test_the_three_files_renamed_together_still_check(tmp_path):
    prefix = written(tmp_path)
    renamed = str(tmp_path / "moved" / "corpus_text_document")
    os.mkdir(tmp_path / "moved")
    for suffix in (".bin", ".idx", ".checksum.json"):
        os.rename(prefix + suffix, renamed + suffix)
    assert MMapIndexedDataset(renamed).checksum_verified
    flip_bit(f"{renamed}.bin", 0, 0)
    assert_refused(renamed, f"{renamed}.bin")


def test_rebuilding_a_data_set_replaces_its_checksum_file(tmp_path):
    prefix = written(tmp_path)
    write_corpus(tmp_path / "d", [7] * 5)  # another data set under the same prefix
    dataset = MMapIndexedDataset(prefix)
    assert dataset.checksum_verified and dataset.sizes.tolist() == [7] * 5
    assert np.array_equal(dataset[4], np.arange(28, 35))
