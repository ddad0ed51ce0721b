"""Megatron's memory-mapped indexed dataset: token sequences in PREFIX.bin, their index in PREFIX.idx.

The byte layout is Megatron-LM's, so files written here load there and the other way round:

    PREFIX.idx  magic b"MMIDIDX\\x00\\x00" | version <Q = 1 | dtype code <B | num_sequences <Q |
                num_doc_idx <Q | sizes int32[num_sequences] | pointers int64[num_sequences] |
                doc_idx int64[num_doc_idx]
    PREFIX.bin  the tokens of every sequence, back to back, in the dtype named by the code

`pointers` are byte offsets of each sequence in .bin; `doc_idx` lists the sequence at which each
document starts, beginning with 0 and ending with num_sequences. A document without tokens has no
sequence, so its entry repeats the next one (Megatron-LM's preprocessing writes an empty row so).

Opening checks the whole index in a few vectorised passes: an integer token dtype, the exact file
sizes, sizes >= 0, pointers that follow the sizes from byte 0 to the end of .bin, and a doc_idx
that runs from 0 to num_sequences without decreasing. Then both files are checked against the
checksums recorded beside them when they were written, in PREFIX.checksum.json (token_checksum.py),
which Megatron-LM ignores; data written before that file existed opens without it.
"""

import glob
import os
import struct

import numpy as np

from megatron.data.token_checksum import checksum_path, verify_checksums, write_checksums
from megatron.errors import DataError

_MAGIC = b"MMIDIDX\x00\x00"
_VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, num sequences, num doc_idx

# Megatron's codes for token dtypes. Its float codes (6: float64, 7: float32) are left out: token
# ids are integers, and a float code over integer tokens reads every id as about 0 without a trace.
DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    8: np.dtype(np.uint16),
}
_CODE_OF_DTYPE = {dtype: code for code, dtype in DTYPE_CODES.items()}
FLOAT_CODES = {6: "float64", 7: "float32"}

# Megatron switches to int32 a little below 2**16, and readers rely on that exact threshold.
_UINT16_VOCAB_LIMIT = 65500


def idx_path(prefix: str) -> str:
    return prefix + ".idx"


def bin_path(prefix: str) -> str:
    return prefix + ".bin"


def dataset_exists(prefix: str) -> bool:
    return os.path.isfile(idx_path(prefix)) and os.path.isfile(bin_path(prefix))


def best_fitting_dtype(vocab_size: int) -> np.dtype:
    """The smallest token dtype Megatron uses for a vocabulary of this size."""
    if vocab_size < _UINT16_VOCAB_LIMIT:
        return np.dtype(np.uint16)
    return np.dtype(np.int32)


def _dtype_code(dtype: np.dtype, where: str) -> int:
    code = _CODE_OF_DTYPE.get(np.dtype(dtype))
    if code is None:
        supported = ", ".join(str(d) for d in DTYPE_CODES.values())
        raise DataError(f"{where}: {np.dtype(dtype)} is not a token dtype; use one of {supported}.")
    return code


class MMapIndexedDatasetBuilder:
    """Appends token sequences to a .bin file and writes the matching .idx on `finalize`.

    Tokens go to BIN.tmp and both files are renamed into place only by `finalize`, so a crash or
    an error never leaves a half-written data set under the final names (nor clobbers an old one).
    Use as a context manager to remove the temporary file when something fails before `finalize`.
    `finalize` then records both files' checksums in PREFIX.checksum.json (PREFIX: the .idx path
    without .idx), removing an older data set's one first: a crash between the renames leaves the
    new data without a checksum file (it opens unchecked), never with the old data's checksums.
    """

    def __init__(self, bin_path: str, dtype: np.dtype, vocab_size: int | None = None) -> None:
        self.dtype = np.dtype(dtype)
        _dtype_code(self.dtype, bin_path)
        if vocab_size is not None and np.issubdtype(self.dtype, np.integer):
            largest_id = vocab_size - 1
            if largest_id > np.iinfo(self.dtype).max:
                raise DataError(
                    f"{bin_path}: a vocabulary of {vocab_size} ids does not fit in {self.dtype} tokens "
                    f"(largest {np.iinfo(self.dtype).max}); use int32."
                )
        self._bin_path = bin_path
        self._tmp_path = bin_path + ".tmp"
        self._file = open(self._tmp_path, "wb")  # noqa: SIM115 (held until finalize, or __exit__)
        self._sizes: list[int] = []
        self._doc_idx: list[int] = [0]

    def add_item(self, tokens) -> None:
        array = np.asarray(tokens, dtype=self.dtype)
        self._file.write(array.tobytes(order="C"))
        self._sizes.append(array.size)

    def add_document(self, tokens) -> None:
        """One document as one sequence, as tools/preprocess_data.py writes it. An empty document gets
        no sequence, only its doc_idx entry, as Megatron-LM's add_document with no lengths records it."""
        if len(tokens):
            self.add_item(tokens)
        self.end_document()

    def end_document(self) -> None:
        self._doc_idx.append(len(self._sizes))

    def finalize(self, idx_path: str) -> None:
        self._file.close()
        sizes = np.asarray(self._sizes, dtype=np.int32)
        pointers = np.zeros(len(sizes), dtype=np.int64)
        np.cumsum(sizes[:-1], dtype=np.int64, out=pointers[1:])
        pointers *= self.dtype.itemsize
        doc_idx = np.asarray(self._doc_idx, dtype=np.int64)
        tmp_idx = idx_path + ".tmp"
        with open(tmp_idx, "wb") as f:
            f.write(_HEADER.pack(_MAGIC, _VERSION, _dtype_code(self.dtype, idx_path), len(sizes), len(doc_idx)))
            f.write(sizes.tobytes(order="C"))
            f.write(pointers.tobytes(order="C"))
            f.write(doc_idx.tobytes(order="C"))
        prefix = idx_path.removesuffix(".idx")
        if os.path.isfile(checksum_path(prefix)):
            os.remove(checksum_path(prefix))
        os.replace(self._tmp_path, self._bin_path)
        os.replace(tmp_idx, idx_path)
        write_checksums(prefix, self._bin_path, idx_path)

    def __enter__(self) -> "MMapIndexedDatasetBuilder":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self._file.closed:  # finalize was not reached: drop the partial tokens
            self._file.close()
            os.remove(self._tmp_path)


def _read_header(index_file: str) -> tuple[np.dtype, int, int]:
    """(token dtype, num_sequences, num_doc_idx) from the header, checked against the file's exact size."""
    with open(index_file, "rb") as f:
        header = f.read(_HEADER.size)
    if not _MAGIC.startswith(header[: len(_MAGIC)]):
        raise DataError(
            f"{index_file} is not a Megatron mmap index (bad magic bytes); regenerate it with tools/preprocess_data.py."
        )
    if len(header) < _HEADER.size:
        raise DataError(f"{index_file} is truncated inside its header; regenerate it with tools/preprocess_data.py.")
    _, version, code, num_sequences, num_doc_idx = _HEADER.unpack(header)
    if version != _VERSION:
        raise DataError(
            f"{index_file} has index version {version}, but only version {_VERSION} is supported; "
            "regenerate it with tools/preprocess_data.py."
        )
    if code in FLOAT_CODES:
        raise DataError(
            f"{index_file} declares {FLOAT_CODES[code]} tokens (Megatron's dtype code {code}), but token data "
            "must be integers; preprocess the text again with tools/preprocess_data.py, which writes integer ids."
        )
    if code not in DTYPE_CODES:
        raise DataError(
            f"{index_file} declares unknown dtype code {code} (token codes: {', '.join(map(str, DTYPE_CODES))}); "
            "the file is corrupt, regenerate it with tools/preprocess_data.py."
        )
    expected = _HEADER.size + num_sequences * (4 + 8) + num_doc_idx * 8
    index_size = os.path.getsize(index_file)
    if index_size != expected:
        damage = "truncated" if index_size < expected else "longer than its header says"
        raise DataError(
            f"{index_file} is {damage}: its header declares {num_sequences} sequences and {num_doc_idx} "
            f"document entries ({expected} bytes) but the file has {index_size} bytes; "
            "regenerate it with tools/preprocess_data.py."
        )
    if num_sequences == 0:
        raise DataError(f"{index_file} holds zero sequences; the corpus was empty, preprocess a non-empty one.")
    return DTYPE_CODES[code], num_sequences, num_doc_idx


def _check_index_arrays(
    index_file: str, sizes: np.ndarray, pointers: np.ndarray, doc_idx: np.ndarray, itemsize: int
) -> int:
    """Check that the arrays describe sequences laid back to back from byte 0; return the .bin size they describe.

    Vectorised over the whole index: each pointer must be the sum of the sizes before it, so one
    damaged size or pointer anywhere shows up as a pointer that does not follow.
    """
    if sizes.min() < 0:
        sequence = int(np.argmax(sizes < 0))
        raise DataError(
            f"{index_file} gives sequence {sequence} a negative size ({int(sizes[sequence])} tokens); "
            "the index is corrupt, regenerate it with tools/preprocess_data.py."
        )
    ends = np.cumsum(sizes, dtype=np.int64)
    ends *= itemsize
    misplaced = pointers[1:] != ends[:-1]
    if pointers[0] != 0 or misplaced.any():
        sequence = 0 if pointers[0] != 0 else 1 + int(np.argmax(misplaced))
        should_be = 0 if sequence == 0 else int(ends[sequence - 1])
        raise DataError(
            f"{index_file} says sequence {sequence} starts at byte {int(pointers[sequence])} of the .bin file, "
            f"but the sizes before it put it at byte {should_be}; the index is corrupt, "
            "regenerate it with tools/preprocess_data.py."
        )
    num_sequences = len(sizes)
    if len(doc_idx) < 1 or doc_idx[0] != 0 or doc_idx[-1] != num_sequences or (doc_idx[1:] < doc_idx[:-1]).any():
        raise DataError(
            f"{index_file} has a corrupt document index (it must start at 0, never decrease and end at "
            f"{num_sequences}); regenerate it with tools/preprocess_data.py."
        )
    return int(ends[-1])


def _without_file_suffix(prefix: str) -> str:
    """The prefix a path names once a .bin or .idx it was given with is dropped."""
    for suffix in (".bin", ".idx"):
        if prefix.endswith(suffix):
            return prefix.removesuffix(suffix)
    return prefix


def _prefixes_beside(prefix: str) -> list[str]:
    """Data sets a user most likely meant by a prefix that has none: the prefix without a .bin or
    .idx it was given with, else what tools/preprocess_data.py writes for --output-prefix PREFIX
    (PREFIX_text_document first, then PREFIX_{key}_document for its other --json-keys)."""
    if _without_file_suffix(prefix) != prefix and dataset_exists(_without_file_suffix(prefix)):
        return [_without_file_suffix(prefix)]
    if dataset_exists(f"{prefix}_text_document"):
        return [f"{prefix}_text_document"]
    found = sorted(glob.glob(f"{glob.escape(prefix)}_*_document.bin"))
    return [p for p in (path.removesuffix(".bin") for path in found) if dataset_exists(p)]


def missing_dataset_error(prefix: str) -> DataError:
    """The error for a prefix with no data set: it names the prefix to use when one lies beside it,
    else the one of its two files that is missing."""
    beside = _prefixes_beside(prefix)
    if len(beside) == 1:
        return DataError(
            f"no indexed dataset at prefix {prefix!r}, but {beside[0]!r} beside it has its .bin and .idx; "
            f"pass the prefix {beside[0]!r} instead."
        )
    if beside:
        return DataError(
            f"no indexed dataset at prefix {prefix!r}, but {', '.join(map(repr, beside))} beside it have their "
            ".bin and .idx (one per --json-keys key of tools/preprocess_data.py); pass one of those prefixes instead."
        )
    for named in dict.fromkeys((prefix, _without_file_suffix(prefix))):
        present = [path for path in (idx_path(named), bin_path(named)) if os.path.isfile(path)]
        if present:
            missing = bin_path(named) if present[0] == idx_path(named) else idx_path(named)
            meant = "" if named == prefix else f" (a data path is the prefix without {prefix[len(named) :]})"
            return DataError(
                f"no indexed dataset at prefix {prefix!r}{meant}: {missing} is missing beside {present[0]}; "
                "produce both with tools/preprocess_data.py."
            )
    return DataError(
        f"no indexed dataset at prefix {prefix!r}: both {idx_path(prefix)} and {bin_path(prefix)} are "
        "needed; produce them with tools/preprocess_data.py."
    )


class MMapIndexedDataset:
    """Read-only, memory-mapped view of PREFIX.idx / PREFIX.bin, checked on open.

    With `verify_checksum` (the default) both files are also read once against PREFIX.checksum.json,
    here, in the process that opens them, before any DataLoader worker starts: a file that changed
    since it was written stops with a DataError. `checksum_verified` says whether that check ran
    and passed (False: skipped, or data written before checksums were recorded). A worker that
    receives the data set by pickling reopens it without reading it all again.
    """

    def __init__(self, path_prefix: str, verify_checksum: bool = True) -> None:
        self.path_prefix = path_prefix
        self._open()
        self.checksum_verified = verify_checksum and verify_checksums(
            path_prefix, bin_path(path_prefix), idx_path(path_prefix)
        )

    def _open(self) -> None:
        prefix = self.path_prefix
        if not dataset_exists(prefix):
            raise missing_dataset_error(prefix)
        index_file, data_file = idx_path(prefix), bin_path(prefix)
        self.dtype, num_sequences, num_doc_idx = _read_header(index_file)
        index = np.memmap(index_file, mode="r", dtype=np.uint8)
        offset = _HEADER.size
        self.sizes = np.frombuffer(index, dtype=np.int32, count=num_sequences, offset=offset)
        offset += self.sizes.nbytes
        self.pointers = np.frombuffer(index, dtype=np.int64, count=num_sequences, offset=offset)
        offset += self.pointers.nbytes
        self.doc_idx = np.frombuffer(index, dtype=np.int64, count=num_doc_idx, offset=offset)
        expected = _check_index_arrays(index_file, self.sizes, self.pointers, self.doc_idx, self.dtype.itemsize)
        actual = os.path.getsize(data_file)
        if actual != expected:
            raise DataError(
                f"{data_file} has {actual} bytes but {index_file} describes {expected}; the pair does not "
                "belong together or one is truncated, so regenerate both with tools/preprocess_data.py."
            )
        if actual == 0:
            raise DataError(f"{data_file} holds no tokens (every sequence is empty); preprocess a non-empty corpus.")
        self._bin = np.memmap(data_file, mode="r", dtype=np.uint8)

    def __len__(self) -> int:
        return len(self.sizes)

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset + length) of sequence `idx` (to its end when length is None)."""
        size = int(self.sizes[idx])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"tokens [{offset}, {offset + length}) are outside sequence {idx} of {size} tokens")
        start = int(self.pointers[idx]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin, dtype=self.dtype, count=length, offset=start)

    def __getitem__(self, idx: int) -> np.ndarray:
        return self.get(idx)

    # Pickle by path (DataLoader workers started with spawn) rather than copying the mapped bytes;
    # the copy reopens the files (checking the index again, which is fast) but does not read them
    # against their checksums again: the process that pickled it did, and says so.
    def __getstate__(self) -> tuple[str, bool]:
        return self.path_prefix, self.checksum_verified

    def __setstate__(self, state: tuple[str, bool]) -> None:
        self.path_prefix, self.checksum_verified = state
        self._open()
