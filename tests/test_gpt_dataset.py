"""GPT samples, index caches, splits, blending and the resumable loader."""

import math
import os
import resource
import signal

import numpy as np
import pytest
import torch

from megatron.data.blending import BlendedDataset, build_blending_indices, parse_weighted_prefixes
from megatron.data.gpt_dataset import (
    SPLIT_LEGACY,
    SPLIT_ROUNDINGS,
    GPTDataset,
    build_train_valid_test_datasets,
    get_train_valid_test_split,
)
from megatron.data.indexed_dataset import MMapIndexedDataset, MMapIndexedDatasetBuilder
from megatron.data.loader import build_pretraining_loader
from megatron.errors import ConfigError, DataError


def write_corpus(prefix, lengths, first_token=0):
    """One sequence per document; tokens count up so every window of the stream is distinct."""
    builder = MMapIndexedDatasetBuilder(f"{prefix}.bin", np.int32)
    token = first_token
    for length in lengths:
        builder.add_item(np.arange(token, token + length))
        builder.end_document()
        token += length
    builder.finalize(f"{prefix}.idx")
    return MMapIndexedDataset(str(prefix))


def random_lengths(count, seed=0):
    lengths = np.random.RandomState(seed).randint(0, 30, size=count)
    lengths[[3, 4]] = 0  # empty documents must be stepped over
    return lengths


def megatron_sample_idx(sizes, doc_idx, seq_length, num_samples):
    """Megatron's helpers.cpp walk, transcribed literally, as the reference."""
    rows = [(0, 0)]
    doc_index, offset = 0, 0
    while len(rows) <= num_samples:
        remaining = seq_length + 1
        while remaining != 0:
            length = sizes[doc_idx[doc_index]] - offset
            remaining -= length
            if remaining <= 0:
                offset += remaining + length - 1
                remaining = 0
            else:
                doc_index += 1
                offset = 0
        rows.append((doc_index, offset))
    return np.array(rows, dtype=np.int32)


def stream(dataset, doc_idx):
    return np.concatenate([dataset[int(d)] for d in doc_idx]).astype(np.int64)


@pytest.mark.parametrize("num_samples, seq_length", [(10, 16), (150, 7), (400, 5)])
def test_samples_are_windows_of_the_shuffled_stream(tmp_path, num_samples, seq_length):
    indexed = write_corpus(tmp_path / "d", random_lengths(40))
    documents = np.arange(2, 38, dtype=np.int32)
    dataset = GPTDataset("train", indexed, documents, num_samples, seq_length, seed=1234)
    assert len(dataset) >= num_samples
    tokens = stream(indexed, dataset.doc_idx)
    for i in range(len(dataset)):
        start = int(dataset.shuffle_idx[i]) * seq_length
        sample = dataset[i]["text"]
        assert sample.dtype == np.int64
        np.testing.assert_array_equal(sample, tokens[start : start + seq_length + 1])
    total_samples = len(dataset)
    expected_rows = megatron_sample_idx(indexed.sizes, dataset.doc_idx, seq_length, total_samples)
    np.testing.assert_array_equal(dataset.sample_idx, expected_rows)
    # Consecutive samples (in unshuffled order) share one token.
    by_position = {int(s): i for i, s in enumerate(dataset.shuffle_idx)}
    for s in range(total_samples - 1):
        assert dataset[by_position[s]]["text"][-1] == dataset[by_position[s + 1]]["text"][0]


def test_epochs_and_shuffles_follow_megatron(tmp_path):
    lengths = random_lengths(20)
    indexed = write_corpus(tmp_path / "d", lengths)
    documents = np.arange(20, dtype=np.int32)
    tokens_per_epoch, seq_length = int(lengths.sum()), 8
    samples_per_epoch = (tokens_per_epoch - 1) // seq_length
    # 2 epochs plus a sliver of a third: the last epoch is built and shuffled apart.
    num_samples = (2 * tokens_per_epoch - 1) // seq_length + 3
    dataset = GPTDataset("train", indexed, documents, num_samples, seq_length, seed=7)

    rng = np.random.RandomState(7)
    first_epochs = np.concatenate([documents, documents]).astype(np.int32)
    rng.shuffle(first_epochs)
    last_epoch = documents.copy()
    rng.shuffle(last_epoch)
    np.testing.assert_array_equal(dataset.doc_idx, np.concatenate([first_epochs, last_epoch]))
    total = (3 * tokens_per_epoch - 1) // seq_length
    before_last = (2 * tokens_per_epoch - 1) // seq_length
    assert len(dataset) == total and num_samples - before_last < 0.8 * samples_per_epoch
    head, tail = np.arange(before_last, dtype=np.uint32), np.arange(before_last, total, dtype=np.uint32)
    rng.shuffle(head)
    rng.shuffle(tail)
    assert dataset.shuffle_idx.dtype == np.uint32
    np.testing.assert_array_equal(dataset.shuffle_idx, np.concatenate([head, tail]))


def test_full_last_epoch_is_shuffled_with_the_rest(tmp_path):
    lengths = random_lengths(20)
    indexed = write_corpus(tmp_path / "d", lengths)
    documents = np.arange(20, dtype=np.int32)
    num_samples = (2 * int(lengths.sum()) - 1) // 8 - 1  # nearly two whole epochs
    dataset = GPTDataset("train", indexed, documents, num_samples, 8, seed=3)
    rng = np.random.RandomState(3)
    doc_idx = np.tile(documents, 2)
    rng.shuffle(doc_idx)
    np.testing.assert_array_equal(dataset.doc_idx, doc_idx)
    assert sorted(dataset.shuffle_idx.tolist()) == list(range(len(dataset)))


def test_index_cache_is_written_and_reused(tmp_path):
    indexed = write_corpus(tmp_path / "d", random_lengths(30))
    documents = np.arange(30, dtype=np.int32)
    first = GPTDataset("train", indexed, documents, 50, 16, seed=5)
    for kind in ("doc", "sample", "shuffle"):
        assert os.path.isfile(tmp_path / f"d_train_indexmap_50ns_16sl_5s_{kind}_idx.npy")
    assert not [name for name in os.listdir(tmp_path) if name.endswith(".tmp")]
    assert not isinstance(first.sample_idx, np.memmap)  # built arrays are served from memory
    again = GPTDataset("train", MMapIndexedDataset(str(tmp_path / "d")), documents, 50, 16, seed=5)
    # mapped from the files: loaded, not rebuilt
    assert all(isinstance(a, np.memmap) for a in (again.doc_idx, again.sample_idx, again.shuffle_idx))
    for i in range(len(first)):
        np.testing.assert_array_equal(first[i]["text"], again[i]["text"])


def test_unwritable_cache_falls_back_to_memory(tmp_path, caplog):
    """A disk that takes no more bytes (a file-size limit of 0: EFBIG, as a full or read-only disk
    fails a write even for root) leaves the arrays in memory, with a warning and no litter."""
    indexed = write_corpus(tmp_path / "d", random_lengths(30))
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails instead of killing the process
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, limits[1]))
    try:
        dataset = GPTDataset("train", indexed, np.arange(30, dtype=np.int32), 10, 16, seed=5)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, handler)
    assert len(dataset) >= 10 and not [name for name in os.listdir(tmp_path) if name.endswith((".npy", ".tmp"))]
    assert "could not cache GPT index arrays" in caplog.text


def test_stale_cache_for_other_documents_is_rebuilt(tmp_path):
    indexed = write_corpus(tmp_path / "d", random_lengths(30))
    GPTDataset("train", indexed, np.arange(0, 20, dtype=np.int32), 10, 16, seed=5)
    moved = GPTDataset("train", indexed, np.arange(10, 30, dtype=np.int32), 10, 16, seed=5)
    assert moved.doc_idx.min() == 10
    reloaded = GPTDataset("train", indexed, np.arange(10, 30, dtype=np.int32), 10, 16, seed=5)
    np.testing.assert_array_equal(moved.doc_idx, reloaded.doc_idx)


def test_documents_without_tokens(tmp_path):
    indexed = write_corpus(tmp_path / "d", [5, 0, 0, 5])
    with pytest.raises(DataError, match="valid documents hold no tokens"):
        GPTDataset("valid", indexed, np.arange(1, 3, dtype=np.int32), 10, 4, seed=1)


def test_split():
    # Worked by hand: thirds of 10 end at 3.33, 6.67 and 10, rounded to 3, 7, 10 (cumulative); the
    # legacy way rounds each third to 3, falls one short of 10 and shifts every boundary by one.
    assert get_train_valid_test_split("1,1,1", 10) == [0, 3, 7, 10]
    assert get_train_valid_test_split("1,1,1", 10, SPLIT_LEGACY) == [0, 4, 7, 10]
    for rounding in SPLIT_ROUNDINGS:
        assert get_train_valid_test_split("969,30,1", 1000, rounding) == [0, 969, 999, 1000]
        assert get_train_valid_test_split("98/2", 10, rounding) == [0, 10, 10, 10]
        assert get_train_valid_test_split("1", 7, rounding) == [0, 7, 7, 7]
        assert get_train_valid_test_split("0.5,0.25,0.25", 7, rounding)[-1] == 7
    for bad in ("a,b", "-1,2", "0,0,0", "1,2,3,4", "inf,1", "nan"):
        with pytest.raises(ConfigError, match="--split"):
            get_train_valid_test_split(bad, 10)
    # Legacy: 0 + 2 + 2 overshoots 3 by one, and the shift would start valid at sequence -1.
    with pytest.raises(ConfigError, match=r"--split '0,1,1' cannot divide 3 sequences"):
        get_train_valid_test_split("0,1,1", 3, SPLIT_LEGACY)
    assert get_train_valid_test_split("0,1,1", 3) == [0, 0, 2, 3]
    with pytest.raises(ConfigError, match="--split-rounding 'nearest' is not a rounding"):
        get_train_valid_test_split("1", 3, "nearest")


def test_train_valid_test_from_one_prefix(tmp_path):
    write_corpus(tmp_path / "d", [10] * 100)
    train, valid, test = build_train_valid_test_datasets([str(tmp_path / "d")], "90,10,0", (40, 5, 0), 8, 1)
    assert test is None
    assert sorted(set(train.doc_idx.tolist())) == list(range(90))
    assert sorted(set(valid.doc_idx.tolist())) == list(range(90, 100))
    assert len(train) >= 40 and len(valid) >= 5


def test_separate_prefixes_are_used_whole(tmp_path):
    write_corpus(tmp_path / "a", [10] * 20)
    write_corpus(tmp_path / "b", [10] * 5, first_token=1000)
    train, valid, test = build_train_valid_test_datasets(
        None,
        "969,30,1",
        (20, 4, 4),
        8,
        1,
        train_data_prefix=[str(tmp_path / "a")],
        valid_data_prefix=[str(tmp_path / "b")],
    )
    assert test is None
    assert sorted(set(train.doc_idx.tolist())) == list(range(20))
    assert sorted(set(valid.doc_idx.tolist())) == list(range(5)) and valid[0]["text"].min() >= 1000
    with pytest.raises(ConfigError, match="--data-path"):
        build_train_valid_test_datasets(None, "1", (1, 1, 1), 8, 1)


def test_blended_prefixes(tmp_path):
    write_corpus(tmp_path / "a", [10] * 50)
    write_corpus(tmp_path / "b", [10] * 50, first_token=10_000)
    train, valid, _ = build_train_valid_test_datasets(
        ["3", str(tmp_path / "a"), "1", str(tmp_path / "b")], "80,20,0", (200, 20, 0), 8, 1
    )
    assert isinstance(train, BlendedDataset)
    assert len(train) == math.ceil(200 * 0.75 * 1.005) + math.ceil(200 * 0.25 * 1.005)
    from_b = sum(int(train[i]["text"][0] >= 10_000) for i in range(len(train)))
    assert abs(from_b - 0.25 * len(train)) <= 1
    assert isinstance(valid, BlendedDataset) and len(valid) == math.ceil(20 * 0.75 * 1.005) + math.ceil(
        20 * 0.25 * 1.005
    )


def test_blend_member_without_documents_in_a_split_drops_out(tmp_path):
    write_corpus(tmp_path / "a", [10] * 50)
    write_corpus(tmp_path / "b", [10] * 2, first_token=10_000)  # 80,20 of 2 documents leaves valid empty
    _, valid, _ = build_train_valid_test_datasets(
        ["1", str(tmp_path / "a"), "1", str(tmp_path / "b")], "80,20,0", (100, 30, 0), 8, 1
    )
    assert len(valid) == math.ceil(30 * 1.005) and len(valid.datasets) == 1
    assert all(valid[i]["text"][0] < 10_000 for i in range(len(valid)))


def test_blending_index_sequence():
    dataset_index, sample_index = build_blending_indices(np.array([0.6, 0.4]), 8)
    # Worked by hand: i=1 scores (-0.4, 0.4); i=5 ties at (0.0, 0.0) and takes the first.
    assert dataset_index.tolist() == [0, 1, 0, 1, 0, 0, 1, 0]
    assert sample_index.tolist() == [0, 0, 1, 1, 2, 3, 2, 4]
    dataset_index, _ = build_blending_indices(np.array([0.5, 0.3, 0.2]), 1000)
    assert np.bincount(dataset_index).tolist() == [500, 300, 200]


def test_blended_dataset_serves_samples_in_order():
    first = [{"text": np.array([0, i])} for i in range(10)]
    second = [{"text": np.array([1, i])} for i in range(10)]
    blended = BlendedDataset([first, second], [3.0, 1.0], 8)
    assert [tuple(blended[i]["text"]) for i in range(8)] == [
        (0, 0),
        (1, 0),
        (0, 1),
        (0, 2),
        (0, 3),
        (1, 1),
        (0, 4),
        (0, 5),
    ]
    with pytest.raises(DataError, match="draws 6 samples from data set 0"):
        BlendedDataset([first[:5], second], [3.0, 1.0], 8)


@pytest.mark.parametrize(
    "items, message",
    [(["1", "a", "2"], "pairs"), (["x", "a"], "'x' is not a number"), (["-1", "a", "2", "b"], "non-negative")],
)
def test_parse_weighted_prefixes_errors(items, message):
    with pytest.raises(ConfigError, match=message):
        parse_weighted_prefixes(items)
    assert parse_weighted_prefixes(["1", " a", "3", "b"]) == (["a", "b"], [0.25, 0.75])


class CountingDataset(torch.utils.data.Dataset):
    def __len__(self):
        return 23

    def __getitem__(self, i):
        return {"text": np.full(5, i, dtype=np.int64)}


def batches(consumed, rank, dp_size=2, mbs=3):
    loader = build_pretraining_loader(CountingDataset(), consumed, mbs, rank, dp_size)
    return [batch["text"][:, 0].tolist() for batch in loader]


def test_loader_ranks_partition_each_step():
    rank0, rank1 = batches(0, 0), batches(0, 1)
    assert rank0 == [[0, 1, 2], [6, 7, 8], [12, 13, 14]]
    assert rank1 == [[3, 4, 5], [9, 10, 11], [15, 16, 17]]  # 18..22 is an incomplete step: dropped
    batch = next(iter(build_pretraining_loader(CountingDataset(), 0, 3, 0, 2)))
    assert batch["text"].dtype == torch.int64 and batch["text"].shape == (3, 5)


def test_loader_resume_matches_uninterrupted_run():
    for rank in (0, 1):
        assert batches(12, rank) == batches(0, rank)[2:]
        assert batches(6, rank, dp_size=2, mbs=3) == batches(0, rank)[1:]
    with pytest.raises(DataError, match="consumed sample 23.*23 samples"):
        batches(23, 0)
    with pytest.raises(ConfigError):
        batches(0, 2)
