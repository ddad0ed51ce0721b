"""Megatron's GPT dataset: fixed-length samples cut from a shuffled stream of documents.

Three index arrays, built exactly as Megatron-LM builds them (same seed -> same samples):
  doc_idx      document order: the documents tiled once per epoch, shuffled with RandomState(seed)
  sample_idx   [num_samples + 1, 2] (index into doc_idx, token offset) where each sample starts;
               sample i spans seq_length + 1 tokens, and shares its last token with sample i + 1
  shuffle_idx  order in which samples are served
They are cached as .npy files next to the data so every rank and every restart reuses them; a
cache that does not fit the documents or is damaged is rebuilt (after one warning).
"""

import itertools
import logging
import math
import os
import uuid
from dataclasses import dataclass

import numpy as np
import torch

from megatron.data.blending import BlendedDataset, parse_weighted_prefixes
from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.data.token_checksum import CHECKSUM_SUFFIX
from megatron.errors import ConfigError, DataError

logger = logging.getLogger(__name__)

# Megatron builds the last epoch apart when it would contribute less than this share of an epoch,
# so its few samples are not diluted across (and pulled forward into) all the earlier epochs.
_SEPARATE_LAST_EPOCH_FRACTION = 0.80
# Extra samples requested from each blended data set, so greedy blending never runs one dry.
_BLEND_OVERSAMPLE = 1.005
_SPLIT_NAMES = ("train", "valid", "test")


def _num_epochs(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """Smallest n with (n * tokens_per_epoch - 1) // seq_length >= num_samples (-1: samples overlap by one)."""
    return max(1, -(-(num_samples * seq_length + 1) // tokens_per_epoch))


def _build_doc_idx(
    documents: np.ndarray, num_epochs: int, np_rng: np.random.RandomState, separate_last_epoch: bool
) -> np.ndarray:
    if separate_last_epoch:
        first = _build_doc_idx(documents, num_epochs - 1, np_rng, False)
        last = _build_doc_idx(documents, 1, np_rng, False)
        return np.concatenate((first, last))
    doc_idx = np.tile(documents, num_epochs).astype(np.int32)
    np_rng.shuffle(doc_idx)
    return doc_idx


def _build_sample_idx(sizes: np.ndarray, doc_idx: np.ndarray, seq_length: int, num_samples: int) -> np.ndarray:
    """Vectorised form of Megatron's walk over doc_idx.

    Sample k starts at token k * seq_length of the concatenated documents. Row k >= 1 records the
    position of the *last* token of sample k - 1 (the walk stops on it), i.e. the document that
    holds that token and the offset inside it; row 0 is (0, 0) as the walk starts there.
    """
    starts = np.zeros(len(doc_idx) + 1, dtype=np.int64)
    np.cumsum(sizes[doc_idx], dtype=np.int64, out=starts[1:])
    positions = np.arange(1, num_samples + 1, dtype=np.int64) * seq_length
    # side="right" skips empty documents: a token belongs to the last document starting at or before it.
    doc_index = np.searchsorted(starts, positions, side="right") - 1
    sample_idx = np.zeros((num_samples + 1, 2), dtype=np.int32)
    sample_idx[1:, 0] = doc_index
    sample_idx[1:, 1] = positions - starts[doc_index]
    return sample_idx


def _shuffle_dtype(total_size: int) -> np.dtype:
    return np.dtype(np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64)


def _build_shuffle_idx(num_samples: int, total_size: int, np_rng: np.random.RandomState) -> np.ndarray:
    """Shuffle [0, num_samples) and [num_samples, total_size) separately, first part first."""
    dtype = _shuffle_dtype(total_size)
    first = np.arange(num_samples, dtype=dtype)
    np_rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    np_rng.shuffle(last)
    return np.concatenate((first, last))


def _build_index_arrays(
    sizes: np.ndarray, documents: np.ndarray, tokens_per_epoch: int, num_samples: int, seq_length: int, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    num_epochs = _num_epochs(tokens_per_epoch, seq_length, num_samples)
    total_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    samples_before_last_epoch = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
    samples_per_epoch = (tokens_per_epoch - 1) // seq_length
    separate_last_epoch = num_epochs > 1 and (
        num_samples - samples_before_last_epoch < int(_SEPARATE_LAST_EPOCH_FRACTION * samples_per_epoch)
    )
    np_rng = np.random.RandomState(seed=seed)
    doc_idx = _build_doc_idx(documents, num_epochs, np_rng, separate_last_epoch)
    sample_idx = _build_sample_idx(sizes, doc_idx, seq_length, total_samples)
    # With a separate last epoch its samples are shuffled apart too, and served after the rest.
    first_shuffled = samples_before_last_epoch if separate_last_epoch else total_samples
    shuffle_idx = _build_shuffle_idx(first_shuffled, total_samples, np_rng)
    return doc_idx, sample_idx, shuffle_idx


def _save_atomically(path: str, array: np.ndarray) -> None:
    """Write to a unique temporary file, then rename: other ranks see the whole file or none.
    (A plain open keeps the umask's permissions, so users sharing the data can read the cache.)"""
    tmp_path = f"{path}.{uuid.uuid4().hex}.tmp"
    try:
        with open(tmp_path, "wb") as f:
            np.save(f, array, allow_pickle=False)
        os.replace(tmp_path, path)
    finally:
        if os.path.exists(tmp_path):  # the write failed (a full disk): leave no litter behind
            os.remove(tmp_path)


def _cache_problem(
    arrays: list[np.ndarray],
    sizes: np.ndarray,
    documents: np.ndarray,
    tokens_per_epoch: int,
    num_samples: int,
    seq_length: int,
) -> str | None:
    """Why cached arrays cannot serve these documents, or None when they can.

    Megatron's file names omit the document range, so a changed --split would otherwise silently
    reuse another split's arrays; and a damaged file must be rebuilt, not crash the run or feed it
    wrong samples. Each check is one numpy pass over an array: dtypes and shapes, doc_idx holding
    each document once per epoch, every sample_idx row at the token where its sample starts,
    shuffle_idx a permutation of the samples.
    """
    doc_idx, sample_idx, shuffle_idx = arrays
    num_epochs = _num_epochs(tokens_per_epoch, seq_length, num_samples)
    total_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    expected = (
        ("doc", doc_idx, np.dtype(np.int32), (num_epochs * len(documents),)),
        ("sample", sample_idx, np.dtype(np.int32), (total_samples + 1, 2)),
        ("shuffle", shuffle_idx, _shuffle_dtype(total_samples), (total_samples,)),
    )
    for kind, array, dtype, shape in expected:
        if array.dtype != dtype or array.shape != shape:
            return f"its {kind} index is {array.dtype} of shape {array.shape}, not {dtype} of shape {shape}"

    first_doc, last_doc = int(documents.min()), int(documents.max())
    if doc_idx.min() < first_doc or doc_idx.max() > last_doc:
        return f"its doc index holds documents outside [{first_doc}, {last_doc}]"
    doc_counts = np.bincount(doc_idx - first_doc, minlength=last_doc - first_doc + 1)
    if not np.array_equal(doc_counts, num_epochs * np.bincount(documents - first_doc, minlength=len(doc_counts))):
        return f"its doc index does not hold each document once in each of {num_epochs} epochs"

    rows, offsets = sample_idx[:, 0], sample_idx[:, 1]
    if rows.min() < 0 or rows.max() >= len(doc_idx) or offsets.min() < 0 or sample_idx[0].any():
        return "its sample index points outside the doc index"
    doc_sizes = sizes[doc_idx]
    doc_starts = np.zeros(len(doc_idx) + 1, dtype=np.int64)
    np.cumsum(doc_sizes, dtype=np.int64, out=doc_starts[1:])
    sample_starts = np.arange(total_samples + 1, dtype=np.int64) * seq_length
    # Row k names the one token k * seq_length of the document stream: inside its document, at that position.
    if (offsets[1:] >= doc_sizes[rows[1:]]).any() or not np.array_equal(doc_starts[rows] + offsets, sample_starts):
        return f"its sample index rows are not every {seq_length}th token of the documents"

    if total_samples and (shuffle_idx.min() < 0 or shuffle_idx.max() >= total_samples):
        return f"its shuffle index points outside the {total_samples} samples"
    served = np.zeros(total_samples, dtype=bool)
    served[shuffle_idx] = True
    if not served.all():
        return "its shuffle index serves some samples twice and others never"
    return None


def _load_cached_array(path: str) -> np.ndarray | str:
    """The memory-mapped array cached in `path`, or why it cannot be loaded."""
    if not os.path.isfile(path):
        return f"{os.path.basename(path)} is missing"
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    # numpy's header parser lets a truncated or garbled file through as ValueError, EOFError,
    # SyntaxError, TypeError or tokenize.TokenError alike (and some of their messages suggest
    # unpickling): the cache is derived data, so whatever stops it loading just means "rebuild".
    except Exception as e:
        return f"{os.path.basename(path)} is truncated or garbled ({type(e).__name__} on loading it)"


def _load_or_build_index_arrays(
    name: str,
    dataset: MMapIndexedDataset,
    documents: np.ndarray,
    tokens_per_epoch: int,
    num_samples: int,
    seq_length: int,
    seed: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The cached index arrays when they are whole and fit these documents, else freshly built ones.

    Ranks need no coordination here: training builds on the first rank before a barrier, so the
    others normally load a cache that is already good. Should another rank still find it damaged
    (say, a node-local copy), it rebuilds and saves too, which is safe: the arrays depend only on
    the arguments, so every rank writes the same bytes, each through its own temporary file and an
    atomic rename, and a reader sees one whole, correct file or the damaged one (and rebuilds).
    """
    stem = f"{dataset.path_prefix}_{name}_indexmap_{num_samples}ns_{seq_length}sl_{seed}s"
    paths = [f"{stem}_{kind}_idx.npy" for kind in ("doc", "sample", "shuffle")]
    if any(os.path.isfile(p) for p in paths):
        cached = [_load_cached_array(p) for p in paths]
        unreadable = [c for c in cached if isinstance(c, str)]
        if unreadable:
            problem = ", ".join(unreadable)
        else:
            problem = _cache_problem(cached, dataset.sizes, documents, tokens_per_epoch, num_samples, seq_length)
        if problem is None:
            return tuple(cached)
        logger.warning(
            "index cache %s_*_idx.npy does not fit these documents or is damaged: %s; rebuilding it", stem, problem
        )
    arrays = _build_index_arrays(dataset.sizes, documents, tokens_per_epoch, num_samples, seq_length, seed)
    try:
        for path, array in zip(paths, arrays):
            _save_atomically(path, array)
    except OSError as e:  # read-only data directory: keep the arrays in memory for this run
        logger.warning(
            "could not cache GPT index arrays next to %s (%s); they will be rebuilt next run", dataset.path_prefix, e
        )
    return arrays


class GPTDataset(torch.utils.data.Dataset):
    """Samples of seq_length + 1 tokens ({"text": int64 array}) drawn from `documents` of a data set.

    With `vocab_size`, reading a sample that holds a token id outside [0, vocab_size) raises a
    DataError naming the document, so data from another tokenizer (or a damaged .bin) stops the run.
    """

    def __init__(
        self,
        name: str,
        indexed_dataset: MMapIndexedDataset,
        documents: np.ndarray,
        num_samples: int,
        seq_length: int,
        seed: int,
        vocab_size: int | None = None,
    ) -> None:
        prefix = indexed_dataset.path_prefix
        if len(documents) == 0 or documents.min() < 0 or documents.max() >= len(indexed_dataset):
            raise DataError(
                f"{prefix}: the {name} documents must be a non-empty range inside its "
                f"{len(indexed_dataset)} sequences; check --split."
            )
        tokens_per_epoch = int(np.sum(indexed_dataset.sizes[documents], dtype=np.int64))
        if tokens_per_epoch == 0:
            raise DataError(
                f"{prefix}: the {name} documents hold no tokens; check --split or preprocess a non-empty corpus."
            )
        if seq_length < 1 or num_samples < 0:
            raise ConfigError(
                f"{name} dataset needs seq_length >= 1 and num_samples >= 0, got {seq_length} and {num_samples}."
            )
        self.name = name
        self.indexed_dataset = indexed_dataset
        self.vocab_size = vocab_size
        self.doc_idx, self.sample_idx, self.shuffle_idx = _load_or_build_index_arrays(
            name, indexed_dataset, documents, tokens_per_epoch, num_samples, seq_length, seed
        )

    def __len__(self) -> int:
        return self.sample_idx.shape[0] - 1

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} is outside the {self.name} dataset of {len(self)} samples")
        sample = int(self.shuffle_idx[i])
        first_doc, first_offset = (int(x) for x in self.sample_idx[sample])
        last_doc, last_offset = (int(x) for x in self.sample_idx[sample + 1])
        sequences = self.doc_idx[first_doc : last_doc + 1]
        get = self.indexed_dataset.get
        if first_doc == last_doc:
            pieces = [get(sequences[0], offset=first_offset, length=last_offset - first_offset + 1)]
        else:
            pieces = [get(sequences[0], offset=first_offset)]
            pieces.extend(get(s) for s in sequences[1:-1])
            pieces.append(get(sequences[-1], length=last_offset + 1))
        tokens = np.concatenate(pieces, dtype=np.int64, casting="unsafe")
        if self.vocab_size is not None and (tokens.min() < 0 or tokens.max() >= self.vocab_size):
            self._raise_bad_token(tokens, sequences, [len(p) for p in pieces])
        return {"text": tokens}

    def _raise_bad_token(self, tokens: np.ndarray, sequences: np.ndarray, piece_lengths: list[int]) -> None:
        """Name the document (and sequence) holding the first out-of-vocabulary id of a sample."""
        position = int(np.argmax((tokens < 0) | (tokens >= self.vocab_size)))
        sequence = int(sequences[np.searchsorted(np.cumsum(piece_lengths), position, side="right")])
        # The document holding a sequence is the last doc_idx entry at or before it (skipping empty documents).
        document = int(np.searchsorted(self.indexed_dataset.doc_idx, sequence, side="right")) - 1
        raise DataError(
            f"{self.indexed_dataset.path_prefix}: document {document} (sequence {sequence}) holds token id "
            f"{int(tokens[position])}, outside the vocabulary of {self.vocab_size} ids; preprocess the data with "
            "the same tokenizer as training."
        )


PretrainingDataset = GPTDataset | BlendedDataset


# How --split weights become boundaries over a data set's sequences. "cumulative": boundary k is
# round(first k weights / total * sequences), as current Megatron-LM (megatron.core's
# BlendedMegatronDatasetBuilder). "legacy": each split's size is rounded, then every boundary is
# shifted so the last one is the total, as Megatron-DeepSpeed and Megatron-LM's megatron/data.
SPLIT_CUMULATIVE = "cumulative"
SPLIT_LEGACY = "legacy"
SPLIT_ROUNDINGS = (SPLIT_CUMULATIVE, SPLIT_LEGACY)


def _split_weights(splits_string: str) -> list[float]:
    """Three non-negative weights with a positive sum from "969,30,1" or "98/2" (missing ones are 0)."""
    separator = "," if "," in splits_string else "/"
    try:
        weights = [float(s) for s in splits_string.split(separator)]
    except ValueError as e:
        raise ConfigError(
            f"--split {splits_string!r} must be up to three numbers separated by ',' or '/', like 969,30,1."
        ) from e
    if len(weights) > 3:
        raise ConfigError(f"--split {splits_string!r} has {len(weights)} weights; give at most three, like 969,30,1.")
    weights += [0.0] * (3 - len(weights))
    if not all(0 <= w < math.inf for w in weights) or sum(weights) <= 0:
        raise ConfigError(f"--split {splits_string!r} needs non-negative weights with a positive sum, like 969,30,1.")
    return weights


def _cumulative_bounds(weights: list[float], size: int) -> list[int]:
    """Megatron-Core's arithmetic: each weight's share, summed left to right, each end rounded half to even."""
    total = sum(weights)
    ends = [0.0]
    for weight in weights:
        ends.append(ends[-1] + weight / total)
    return [round(end * float(size)) for end in ends]


def _legacy_bounds(splits_string: str, weights: list[float], size: int) -> list[int]:
    total = sum(weights)
    bounds = [0]
    for weight in weights:
        bounds.append(bounds[-1] + round(weight / total * float(size)))
    excess = bounds[-1] - size
    bounds[1:] = [b - excess for b in bounds[1:]]
    if any(b < a for a, b in itertools.pairwise(bounds)):
        raise ConfigError(
            f"--split {splits_string!r} cannot divide {size} sequences; give each non-zero split a larger weight."
        )
    return bounds


def get_train_valid_test_split(splits_string: str, size: int, rounding: str = SPLIT_CUMULATIVE) -> list[int]:
    """Sequence boundaries [0, a, b, size] of train, valid and test from weights like "969,30,1"."""
    weights = _split_weights(splits_string)
    if rounding == SPLIT_CUMULATIVE:
        return _cumulative_bounds(weights, size)
    if rounding == SPLIT_LEGACY:
        return _legacy_bounds(splits_string, weights, size)
    raise ConfigError(f"--split-rounding {rounding!r} is not a rounding; choose one of {', '.join(SPLIT_ROUNDINGS)}.")


@dataclass(frozen=True)
class DataSplit:
    """--split as given ("969,30,1") and the rounding that turns it into sequence boundaries."""

    splits_string: str
    rounding: str


class _OpenedDatasets:
    """Each data set opened (and its checksum checked) once per build, however many splits, blend
    entries or spellings of its path ("d", "./d") name it."""

    def __init__(self, verify_checksum: bool) -> None:
        self.verify_checksum = verify_checksum
        self.by_path: dict[str, MMapIndexedDataset] = {}

    def open(self, prefix: str) -> MMapIndexedDataset:
        path = os.path.realpath(prefix)
        if path not in self.by_path:
            self.by_path[path] = MMapIndexedDataset(prefix, verify_checksum=self.verify_checksum)
        return self.by_path[path]

    def log_unchecked(self) -> None:
        """One line for all the data sets written before checksums were recorded, not one per file."""
        unchecked = [d.path_prefix for d in self.by_path.values() if not d.checksum_verified]
        if not self.verify_checksum or not unchecked:
            return
        named = ", ".join(unchecked[:3]) + (f" and {len(unchecked) - 3} more" if len(unchecked) > 3 else "")
        logger.warning(
            "%d of %d data sets have no %s beside them (preprocessed before checksums were recorded), so their "
            "tokens are not checked: %s; re-run tools/preprocess_data.py to record one",
            len(unchecked),
            len(self.by_path),
            "PREFIX" + CHECKSUM_SUFFIX,
            named,
        )


def _split_sequences(
    opened: _OpenedDatasets, prefix: str, split: DataSplit | None, split_index: int
) -> tuple[MMapIndexedDataset, np.ndarray]:
    """A data set and its sequences in one split (all of them when split is None).

    The split counts sequences, not documents, as Megatron-LM's GPT datasets do (old and current):
    a document without tokens (an empty row) has no sequence, so it moves no boundary.
    """
    indexed = opened.open(prefix)
    first, last = 0, len(indexed)
    if split is not None:
        first, last = get_train_valid_test_split(split.splits_string, last, split.rounding)[
            split_index : split_index + 2
        ]
    return indexed, np.arange(first, last, dtype=np.int32)


def _build_dataset(
    opened: _OpenedDatasets,
    name: str,
    data_prefix: list[str],
    split: DataSplit | None,
    split_index: int,
    num_samples: int,
    seq_length: int,
    seed: int,
    vocab_size: int | None,
) -> PretrainingDataset | None:
    if num_samples == 0:
        return None
    if len(data_prefix) == 1:
        indexed, documents = _split_sequences(opened, data_prefix[0], split, split_index)
        if not len(documents):
            return None
        return GPTDataset(name, indexed, documents, num_samples, seq_length, seed, vocab_size)
    prefixes, weights = parse_weighted_prefixes(data_prefix)
    weighted = [(*_split_sequences(opened, p, split, split_index), w) for p, w in zip(prefixes, weights) if w > 0]
    kept = [(indexed, documents, w) for indexed, documents, w in weighted if len(documents)]
    if not kept:
        return None
    if len(kept) < len(weighted):  # a set with no documents in this split: the others share its weight
        total = sum(w for _, _, w in kept)
        kept = [(indexed, documents, w / total) for indexed, documents, w in kept]
    per_dataset_samples = [math.ceil(num_samples * w * _BLEND_OVERSAMPLE) for _, _, w in kept]
    datasets = [
        GPTDataset(name, indexed, documents, n, seq_length, seed, vocab_size)
        for (indexed, documents, _), n in zip(kept, per_dataset_samples)
    ]
    return BlendedDataset(datasets, [w for _, _, w in kept], sum(per_dataset_samples))


def build_train_valid_test_datasets(
    data_prefix: list[str] | None,
    splits_string: str,
    train_valid_test_num_samples: tuple[int, int, int],
    seq_length: int,
    seed: int,
    train_data_prefix: list[str] | None = None,
    valid_data_prefix: list[str] | None = None,
    test_data_prefix: list[str] | None = None,
    vocab_size: int | None = None,
    split_rounding: str = SPLIT_CUMULATIVE,
    verify_checksum: bool = True,
) -> tuple[PretrainingDataset | None, PretrainingDataset | None, PretrainingDataset | None]:
    """(train, valid, test) datasets, each a GPTDataset, a BlendedDataset or None.

    A split's own prefix list (train_data_prefix, ...) is used whole; otherwise the split comes
    from `data_prefix` cut by `splits_string` with `split_rounding` (SPLIT_ROUNDINGS). Prefix lists
    are [p] or [w1, p1, w2, p2, ...].
    With `vocab_size`, every sample read is checked to hold only token ids in [0, vocab_size).
    With `verify_checksum` (--no-data-checksum turns it off), each data set is read once against its
    PREFIX.checksum.json when opened; those without one are named in one log line.
    """
    own_prefixes = (train_data_prefix, valid_data_prefix, test_data_prefix)
    if not data_prefix and not any(own_prefixes):
        raise ConfigError(
            "no training data given; pass --data-path, or --train-data-path/--valid-data-path/--test-data-path."
        )
    split = DataSplit(splits_string, split_rounding)
    opened = _OpenedDatasets(verify_checksum)
    datasets = []
    for index, (name, own, num_samples) in enumerate(zip(_SPLIT_NAMES, own_prefixes, train_valid_test_num_samples)):
        if own:
            datasets.append(_build_dataset(opened, name, own, None, index, num_samples, seq_length, seed, vocab_size))
        elif data_prefix:
            datasets.append(
                _build_dataset(opened, name, data_prefix, split, index, num_samples, seq_length, seed, vocab_size)
            )
        else:
            datasets.append(None)
    opened.log_unchecked()
    return tuple(datasets)
