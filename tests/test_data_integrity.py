"""Data integrity by fault injection (issues 13 and 14): damaged .idx/.bin files and index caches.

Every fault here is made by changing bytes on disk, then the public API is asked to open or read
the data. A damaged .idx or a wrong token id must stop with a DataError that names the file (or
document) and the fix; a damaged sample-index cache must be rebuilt, giving the undamaged samples.
"""

import logging
import os
import re

import numpy as np
import pytest

from megatron.data.gpt_dataset import GPTDataset, build_train_valid_test_datasets
from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.errors import DataError
from tests.test_gpt_dataset import random_lengths, write_corpus
from tests.test_indexed_dataset import DOCUMENTS, write_dataset

HEADER_BYTES = 34  # magic 9 | version 8 | dtype code 1 | num_sequences 8 | num_doc_idx 8


def flip_bit(path, position: int, bit: int) -> None:
    """Flip one bit of a file in place, as bit rot would (flipping it again restores the file).
    In place also spares ext4 the flush it does when a truncated file is written again."""
    with open(path, "r+b") as f:
        f.seek(position)
        byte = f.read(1)[0]
        f.seek(position)
        f.write(bytes([byte ^ (1 << bit)]))


def tokens_of(dataset: MMapIndexedDataset) -> list[list[int]]:
    return [dataset[i].tolist() for i in range(len(dataset))]


def harmless_doc_idx_flips(doc_idx: list[int], num_sequences: int) -> set[tuple[int, int]]:
    """(byte, bit) flips of interior doc_idx entries that leave it non-decreasing.

    They are the only .idx flips no check can see: the file has no checksum, and an index whose
    documents merely start one sequence earlier or later is a valid index. They are harmless to
    GPT samples, which are cut and split by sequence (sizes, pointers, tokens all unchanged, as the
    test shows); doc_idx only names the document in an error. Every other byte is tied down
    by the header's exact file size, the pointers following the sizes and the .bin size.
    """
    first_entry = HEADER_BYTES + 12 * num_sequences
    harmless = set()
    for entry in range(1, len(doc_idx) - 1):
        for bit in range(64):
            value = np.int64(np.uint64(doc_idx[entry]) ^ np.uint64(1 << bit))
            if doc_idx[entry - 1] <= value <= doc_idx[entry + 1]:
                harmless.add((first_entry + 8 * entry + bit // 8, bit % 8))
    return harmless


@pytest.mark.parametrize("dtype, flips, detected", [(np.uint16, 912, 908), (np.int32, 912, 908)])
def test_every_single_bit_flip_in_the_index_is_reported(tmp_path, dtype, flips, detected):
    prefix = write_dataset(tmp_path / "d", dtype=dtype)
    index_file = tmp_path / "d.idx"
    original = index_file.read_bytes()
    reference = MMapIndexedDataset(prefix)
    expected_tokens = tokens_of(reference)
    harmless = harmless_doc_idx_flips(reference.doc_idx.tolist(), len(reference))

    undetected = set()
    for position in range(len(original)):
        for bit in range(8):
            flip_bit(index_file, position, bit)
            try:
                opened = MMapIndexedDataset(prefix)
            except DataError as e:
                assert prefix in str(e) and "tools/preprocess_data.py" in str(e), str(e)
            else:
                undetected.add((position, bit))
                np.testing.assert_array_equal(opened.sizes, reference.sizes)
                np.testing.assert_array_equal(opened.pointers, reference.pointers)
                assert tokens_of(opened) == expected_tokens
            flip_bit(index_file, position, bit)
    assert (8 * len(original), 8 * len(original) - len(undetected)) == (flips, detected)
    assert undetected == harmless


@pytest.mark.parametrize("suffix", [".idx", ".bin"])
def test_every_truncation_and_extension_is_reported(tmp_path, suffix):
    prefix = write_dataset(tmp_path / "d")
    path = tmp_path / f"d{suffix}"
    original = path.read_bytes()
    damaged = [original[:length] for length in range(len(original))]
    damaged += [original + b"\x00" * extra for extra in range(1, 17)]
    for data in damaged:
        path.write_bytes(data)
        with pytest.raises(DataError, match=re.escape(str(path))):
            MMapIndexedDataset(prefix)


# DOCUMENTS as uint16: sizes 3, 1, 4, 2 at byte 34, pointers 0, 6, 8, 16 at byte 50, doc_idx 0, 1, 3, 4 at 82.
FIX = r"; the index is corrupt, regenerate it with tools/preprocess_data\.py\."


@pytest.mark.parametrize(
    "offset, values, message",
    [
        pytest.param(
            66,
            np.array([10]),
            r"d\.idx says sequence 2 starts at byte 10 of the \.bin file, but the "
            r"sizes before it put it at byte 8" + FIX,
            id="pointer",
        ),
        pytest.param(34, np.array([4], dtype=np.int32), r"sequence 1 starts at byte 6 .* at byte 8" + FIX, id="size"),
        pytest.param(50, np.array([2]), r"says sequence 0 starts at byte 2 .* at byte 0" + FIX, id="first pointer"),
        pytest.param(
            34,
            np.array([3, -1, 6, 2], dtype=np.int32),
            r"gives sequence 1 a negative size \(-1 tokens\)" + FIX,
            id="negative size",
        ),
        pytest.param(
            82,
            np.array([0, 3, 1, 4]),
            r"d\.idx has a corrupt document index \(it must start at 0, "
            r"never decrease and end at 4\); regenerate it with tools/preprocess_data\.py\.",
            id="doc_idx",
        ),
        pytest.param(
            114,
            np.zeros(1),
            r"d\.idx is longer than its header says: .* \(114 bytes\) but the file "
            r"has 122 bytes; regenerate it with tools/preprocess_data\.py\.",
            id="extended",
        ),
    ],
)
def test_index_errors_say_what_is_wrong(tmp_path, offset, values, message):
    prefix = write_dataset(tmp_path / "d")
    index = bytearray((tmp_path / "d.idx").read_bytes())
    index[offset : offset + values.nbytes] = values.tobytes()
    (tmp_path / "d.idx").write_bytes(bytes(index))
    with pytest.raises(DataError, match=message):
        MMapIndexedDataset(prefix)


def at(offset: int, value: np.ndarray):
    """A damage that writes `value` over the bytes at `offset`."""
    return lambda data: data[:offset] + value.tobytes() + data[offset + value.nbytes :]


FILE_PAIR = r"; the pair does not belong together or one is truncated, so regenerate both with tools/preprocess_data"
BAD_DOC_IDX = r"d\.idx has a corrupt document index \(it must start at 0, never decrease and end at 4\); "


# One kind of damage per row, to every field of the header and the arrays (same layout as above,
# pointers scaled by the token size) and to the .bin: each stops the open with its own sentence.
@pytest.mark.parametrize(
    "dtype, suffix, damage, message",
    [
        pytest.param(
            np.uint16,
            ".idx",
            at(0, np.frombuffer(b"X", np.uint8)),
            r"d\.idx is not a Megatron mmap index "
            r"\(bad magic bytes\); regenerate it",
            id="magic",
        ),
        pytest.param(
            np.uint16,
            ".idx",
            at(9, np.array([2], np.uint64)),
            r"d\.idx has index version 2, but only "
            r"version 1 is supported; regenerate it",
            id="version",
        ),
        pytest.param(
            np.int32,
            ".idx",
            at(17, np.array([7], np.uint8)),
            r"d\.idx declares float32 tokens \(Megatron's dtype code 7\), but token data must be integers; "
            r"preprocess the text again with tools/preprocess_data\.py",
            id="float32 code",
        ),
        pytest.param(np.int64, ".idx", at(17, np.array([6], np.uint8)), r"declares float64 tokens", id="float64 code"),
        pytest.param(
            np.int64,
            ".idx",
            at(17, np.array([9], np.uint8)),
            r"d\.idx declares unknown dtype code 9 \(token codes: 1, 2, 3, 4, 5, 8\); the file is corrupt, regenerate it",
            id="unknown code",
        ),
        pytest.param(
            np.uint16,
            ".idx",
            at(17, np.array([4], np.uint8)),
            r"d\.idx says sequence 1 starts at byte 6 "
            r"of the \.bin file, but the sizes before it put it at byte 12" + FIX,
            id="wider dtype code",
        ),
        pytest.param(
            np.uint16,
            ".idx",
            at(18, np.array([6, 1], np.uint64)),
            r"says sequence 0 starts at byte 6 .* "
            r"at byte 0" + FIX,
            id="counts shifted, file size kept",
        ),
        pytest.param(
            np.uint16,
            ".idx",
            at(18, np.array([2**40], np.uint64)),
            r"d\.idx is truncated: its header "
            r"declares 1099511627776 sequences",
            id="sequence count",
        ),
        pytest.param(
            np.uint16,
            ".idx",
            at(26, np.array([5], np.uint64)),
            r"d\.idx is truncated: .* 5 document "
            r"entries \(122 bytes\) but the file has 114 bytes",
            id="doc_idx count",
        ),
        pytest.param(
            np.int32,
            ".idx",
            at(74, np.array([10**6])),
            r"says sequence 3 starts at byte 1000000 .* at "
            r"byte 32" + FIX,
            id="last pointer",
        ),
        pytest.param(
            np.uint16, ".idx", at(74, np.array([-2])), r"says sequence 3 starts at byte -2 of", id="negative pointer"
        ),
        pytest.param(
            np.uint16,
            ".idx",
            at(46, np.array([5], np.int32)),
            r"d\.bin has 20 bytes but .*d\.idx describes "
            r"26" + FILE_PAIR,
            id="last size",
        ),
        pytest.param(np.uint16, ".idx", at(82, np.array([1])), BAD_DOC_IDX, id="doc_idx start"),
        pytest.param(np.uint16, ".idx", at(106, np.array([5])), BAD_DOC_IDX, id="doc_idx end"),
        pytest.param(np.uint16, ".idx", at(90, np.array([-1])), BAD_DOC_IDX, id="negative doc_idx"),
        pytest.param(
            np.int32,
            ".bin",
            lambda data: data[:-4],
            r"d\.bin has 36 bytes but .*d\.idx describes 40" + FILE_PAIR,
            id=".bin short of a token",
        ),
        pytest.param(np.uint16, ".bin", lambda data: data + b"\0", r"d\.bin has 21 bytes", id=".bin a byte long"),
        pytest.param(np.uint16, ".bin", lambda data: b"", r"d\.bin has 0 bytes", id=".bin empty"),
    ],
)
def test_every_kind_of_damage_is_caught_at_open(tmp_path, dtype, suffix, damage, message):
    prefix = write_dataset(tmp_path / "d", dtype=dtype)
    path = tmp_path / f"d{suffix}"
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(DataError, match=message):
        MMapIndexedDataset(prefix)


def opens_and_reads_as_before(prefix: str, expected: tuple) -> bool:
    """False when the open stops with a DataError naming the file and the fix; True when it opens and
    reads as `expected` (sizes, pointers, tokens); anything else fails the test."""
    try:
        opened = MMapIndexedDataset(prefix)
    except DataError as e:
        assert f"{prefix}.idx" in str(e) and "tools/preprocess_data.py" in str(e), str(e)
        return False
    assert (opened.sizes.tolist(), opened.pointers.tolist(), tokens_of(opened)) == expected
    return True


# int16 reads DOCUMENTS' ids (all below 2**15) as uint16 does: the only other code that opens.
@pytest.mark.parametrize("dtype, codes_that_open", [(np.uint16, {3, 8}), (np.int32, {4}), (np.int64, {5})])
def test_no_damaged_index_that_opens_reads_other_tokens(tmp_path, dtype, codes_that_open):
    """Every value of the dtype code, then 2000 random overwrites of 1-8 bytes anywhere in the .idx:
    the open stops with a DataError naming the file and the fix, or the data set reads exactly as
    before. Nothing is left to fail later, when the samples are read."""
    prefix = write_dataset(tmp_path / "d", dtype=dtype)
    index_file = tmp_path / "d.idx"
    original = index_file.read_bytes()
    reference = MMapIndexedDataset(prefix)
    expected = (reference.sizes.tolist(), reference.pointers.tolist(), tokens_of(reference))
    opened = set()
    for code in range(256):
        index_file.write_bytes(at(17, np.array([code], np.uint8))(original))
        if opens_and_reads_as_before(prefix, expected):
            opened.add(code)
    assert opened == codes_that_open
    rng = np.random.default_rng(0)
    for _ in range(2000):
        length = int(rng.integers(1, 9))
        damage = at(int(rng.integers(0, len(original) - length + 1)), rng.integers(0, 256, length, np.uint8))
        index_file.write_bytes(damage(original))
        opens_and_reads_as_before(prefix, expected)


def flat_documents() -> list[int]:
    """The document of each token of DOCUMENTS, in .bin order."""
    return [document for document, sequences in enumerate(DOCUMENTS) for sequence in sequences for _ in sequence]


# DOCUMENTS' ids are all below 16, so with vocab_size 16 a flip of bits 0-3 gives another valid id
# (no check can tell it from real data without a checksum) and a flip of any higher bit gives an
# id >= 16, or a negative one for int32's sign bit: every one of those must be reported on reading.
@pytest.mark.parametrize("dtype, flips, detected", [(np.uint16, 160, 120), (np.int32, 320, 280)])
def test_token_flips_outside_the_vocabulary_are_reported_with_their_document(tmp_path, dtype, flips, detected):
    vocab_size, seq_length = 16, 3
    prefix = write_dataset(tmp_path / "d", dtype=dtype)
    data_file = tmp_path / "d.bin"
    documents = np.arange(sum(len(sequences) for sequences in DOCUMENTS), dtype=np.int32)
    num_samples = (len(flat_documents()) - 1) // seq_length  # one epoch: the samples cover every token
    itemsize = np.dtype(dtype).itemsize

    reported = 0
    for token, document in enumerate(flat_documents()):
        for bit in range(8 * itemsize):
            flip_bit(data_file, token * itemsize + bit // 8, bit % 8)
            bad_id = int(np.fromfile(data_file, dtype=dtype)[token])
            dataset = GPTDataset("train", MMapIndexedDataset(prefix), documents, num_samples, seq_length, 1, vocab_size)
            try:
                samples = [dataset[i]["text"] for i in range(len(dataset))]
            except DataError as e:
                assert re.fullmatch(
                    rf"{re.escape(prefix)}: document {document} \(sequence \d\) holds token id {bad_id}, outside the "
                    r"vocabulary of 16 ids; preprocess the data with the same tokenizer as training\.",
                    str(e),
                ), str(e)
                reported += 1
            else:
                assert 0 <= bad_id < vocab_size and bad_id in np.concatenate(samples)
            flip_bit(data_file, token * itemsize + bit // 8, bit % 8)
    assert (len(flat_documents()) * 8 * itemsize, reported) == (flips, detected)


def test_builders_pass_the_vocabulary_to_every_dataset(tmp_path):
    write_corpus(tmp_path / "a", [10] * 20)  # ids 0..199, document d holds 10d..10d+9
    write_corpus(tmp_path / "b", [10] * 20)
    data_prefix = ["1", str(tmp_path / "a"), "1", str(tmp_path / "b")]
    train, _, _ = build_train_valid_test_datasets(data_prefix, "1", (50, 0, 0), 8, 1, vocab_size=200)
    assert all(train[i]["text"].max() < 200 for i in range(len(train)))
    train, _, _ = build_train_valid_test_datasets(data_prefix, "1", (50, 0, 0), 8, 1, vocab_size=150)
    with pytest.raises(DataError, match=r"document (\d+) \(sequence \1\) holds token id 1[5-9]\d, outside") as error:
        for i in range(len(train)):
            train[i]
    document, bad_id = (int(n) for n in re.search(r"document (\d+) .* id (\d+)", str(error.value)).groups())
    assert document == bad_id // 10


CACHE_KINDS = ("doc", "sample", "shuffle")


def save_npy(path, array: np.ndarray) -> None:
    with open(path, "wb") as f:
        np.save(f, array, allow_pickle=False)


def out_of_range(kind: str, array: np.ndarray) -> np.ndarray:
    """A value pointing outside what it indexes: a document, the doc index, the samples."""
    array = np.array(array)
    if kind == "sample":
        array[len(array) // 2, 0] = 10**6
    else:
        array[0] = array.max() + 1
    return array


def wrong_value(kind: str, array: np.ndarray) -> np.ndarray:
    """An in-range value that is still wrong: a document swapped for another of the same length
    (so every sample still starts where it should), a sample starting a token late, a sample twice."""
    array = np.array(array)
    if kind == "doc":
        lengths = random_lengths(30)
        first, other = next((a, b) for a in range(30) for b in range(a + 1, 30) if lengths[a] == lengths[b] > 0)
        array[np.flatnonzero(array == first)[0]] = other
    elif kind == "sample":
        array[len(array) // 2, 1] += 1
    else:
        array[0] = array[1]
    return array


DAMAGES = {
    "truncated": lambda path, kind: path.write_bytes(path.read_bytes()[: os.path.getsize(path) // 2]),
    "random bytes": lambda path, kind: path.write_bytes(np.random.RandomState(0).bytes(os.path.getsize(path))),
    "garbled header": lambda path, kind: path.write_bytes(
        path.read_bytes()[:20] + np.random.RandomState(1).bytes(40) + path.read_bytes()[60:]
    ),
    "out of range": lambda path, kind: save_npy(path, out_of_range(kind, np.load(path))),
    "wrong value": lambda path, kind: save_npy(path, wrong_value(kind, np.load(path))),
    "wrong dtype": lambda path, kind: save_npy(path, np.load(path).astype(np.int64)),
    "wrong shape": lambda path, kind: save_npy(path, np.load(path)[:-1]),
    "deleted": lambda path, kind: os.remove(path),
}


@pytest.fixture
def cached_dataset(tmp_path):
    """A dataset whose index cache is on disk, and its samples (copies, not views of the cache)."""
    indexed = write_corpus(tmp_path / "d", random_lengths(30))
    dataset = GPTDataset("train", indexed, np.arange(30, dtype=np.int32), 50, 16, seed=5)
    return indexed, [dataset[i]["text"] for i in range(len(dataset))]


def reopen(indexed: MMapIndexedDataset) -> GPTDataset:
    return GPTDataset("train", indexed, np.arange(30, dtype=np.int32), 50, 16, seed=5)


def cache_warnings(caplog) -> list[str]:
    messages = [r.getMessage() for r in caplog.records if r.name == "megatron.data.gpt_dataset"]
    caplog.clear()
    return messages


@pytest.mark.parametrize("damage", DAMAGES)
@pytest.mark.parametrize("kind", CACHE_KINDS)
def test_damaged_cache_is_rebuilt_with_one_warning(tmp_path, caplog, cached_dataset, kind, damage):
    indexed, expected = cached_dataset
    DAMAGES[damage](tmp_path / f"d_train_indexmap_50ns_16sl_5s_{kind}_idx.npy", kind)
    caplog.set_level(logging.WARNING, logger="megatron.data.gpt_dataset")
    rebuilt = reopen(indexed)
    (warning,) = cache_warnings(caplog)
    assert warning.startswith(f"index cache {tmp_path / 'd'}_train_indexmap_50ns_16sl_5s_*_idx.npy does not fit")
    assert warning.endswith("rebuilding it")
    assert len(rebuilt) == len(expected)
    for i, sample in enumerate(expected):
        np.testing.assert_array_equal(rebuilt[i]["text"], sample)
    reopen(indexed)  # the rebuilt cache was saved whole: it loads without a warning
    assert cache_warnings(caplog) == []


@pytest.mark.parametrize("kind", CACHE_KINDS)
def test_no_single_bit_flip_in_a_cache_file_changes_the_samples(tmp_path, caplog, kind):
    """One flip per byte (bit = byte % 8), header included: each is seen and rebuilt with a warning,
    the arrays served (they alone decide the samples) always equal the undamaged ones, and the
    rebuilt cache file is the undamaged one again."""
    indexed = write_corpus(tmp_path / "d", [5, 0, 9, 3, 7, 0, 4])

    def load() -> GPTDataset:
        return GPTDataset("train", indexed, np.arange(7, dtype=np.int32), 8, 4, seed=5)

    undamaged = load()
    expected = [np.array(a) for a in (undamaged.doc_idx, undamaged.sample_idx, undamaged.shuffle_idx)]
    path = tmp_path / f"d_train_indexmap_8ns_4sl_5s_{kind}_idx.npy"
    original = path.read_bytes()
    caplog.set_level(logging.WARNING, logger="megatron.data.gpt_dataset")
    rebuilt = 0
    for position in range(len(original)):
        flip_bit(path, position, position % 8)
        dataset = load()
        rebuilt += len(cache_warnings(caplog))
        for served, undamaged_array in zip((dataset.doc_idx, dataset.sample_idx, dataset.shuffle_idx), expected):
            np.testing.assert_array_equal(served, undamaged_array)
        assert path.read_bytes() == original, position
    assert rebuilt == len(original)
