"""The checksum file beside an indexed dataset: PREFIX.checksum.json, written when the data set is
finalized (tools/preprocess_data.py, or any MMapIndexedDatasetBuilder) and checked when it is
opened, so a bit flipped in the tokens stops a run before its first step instead of training on it.

    PREFIX.checksum.json  {"format": 1, "algorithm": "block-sums-64",
                           "files": {"bin": {"bytes": N, "checksum": "<32 hex digits>"},
                                     "idx": {"bytes": M, "checksum": "<32 hex digits>"}}}

Megatron-LM reads only PREFIX.bin and PREFIX.idx, so it ignores this file, and both stay byte for
byte Megatron-LM's. Files are named by role ("bin", "idx"), not by name, so a data set whose three
files are renamed together still checks. The checksum is the one checkpoints use
(megatron/checkpoint/checksum.py): two 64-bit sums over 4 KiB blocks, which catch every single-bit
flip. A thread reads the next 16 MiB while the last is summed, so checking runs close to the speed
of reading alone: 7.9 GB/s from the page cache on the 2-core development VM, 1.04x the time of
reading alone (8.3 GB/s; 1.04-1.27x over six runs), where the same reads with zlib's CRC-32 give
3.2 GB/s and with SHA-256 1.5 GB/s (benchmarks/data_checksum.py, docs/benchmarks.md); from a cold
page cache it should run at the disk's speed (not measured). It guards against damage, not tampering.

Data preprocessed before this file existed has none, and opens unchecked (the GPT dataset builder
says so in one line).
"""

import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from tqdm import tqdm

from megatron.checkpoint.checksum import BlockSum
from megatron.errors import DataError

CHECKSUM_SUFFIX = ".checksum.json"
_FORMAT = 1
_ALGORITHM = "block-sums-64"  # megatron/checkpoint/checksum.py
_ROLES = ("bin", "idx")
_CHUNK_BYTES = 16 << 20
# Files at least this large get a progress bar while they are checked (on a terminal only).
_PROGRESS_BYTES = 1 << 30


def checksum_path(prefix: str) -> str:
    return prefix + CHECKSUM_SUFFIX


def _checksum(path: str, progress: bool) -> tuple[int, str]:
    """Size and checksum of a file, read into two reused buffers in turn: a thread fills one while
    this one sums the other. Files of _PROGRESS_BYTES or more get a bar when `progress` is set."""
    block_sum, size = BlockSum(), 0
    total = os.path.getsize(path)
    current, following = (np.empty(min(_CHUNK_BYTES, max(total, 1)), dtype=np.uint8) for _ in range(2))
    show = progress and total >= _PROGRESS_BYTES
    with (
        open(path, "rb", buffering=0) as handle,
        ThreadPoolExecutor(1, thread_name_prefix="checksum_reader") as reader,
        tqdm(
            total=total,
            unit="B",
            unit_scale=True,
            desc=f"checking {os.path.basename(path)}",
            disable=None if show else True,  # None: shown on a terminal only, never in a log file
            leave=False,
            file=sys.stdout,
        ) as bar,
    ):
        reading = reader.submit(handle.readinto, current)
        while count := reading.result():
            reading = reader.submit(handle.readinto, following)
            block_sum.update(current[:count])
            size += count
            bar.update(count)
            current, following = following, current
    return size, block_sum.hexdigest()


def write_checksums(prefix: str, bin_file: str, idx_file: str) -> None:
    """Record the checksums of `bin_file` and `idx_file` (the files about to become PREFIX.bin and
    PREFIX.idx, or those files themselves) in PREFIX.checksum.json, written to a temporary file and
    renamed into place."""
    files = {}
    for role, path in zip(_ROLES, (bin_file, idx_file)):
        size, checksum = _checksum(path, progress=False)
        files[role] = {"bytes": size, "checksum": checksum}
    path = checksum_path(prefix)
    with open(path + ".tmp", "w") as f:
        json.dump({"format": _FORMAT, "algorithm": _ALGORITHM, "files": files}, f, indent=1)
        f.write("\n")
    os.replace(path + ".tmp", path)


def _recorded(path: str) -> dict[str, dict]:
    """The recorded size and checksum per role, or a DataError naming the file when it is not one of ours."""
    try:
        with open(path) as f:
            record = json.load(f)
        files = record["files"]
        if record["format"] != _FORMAT or record["algorithm"] != _ALGORITHM:
            raise ValueError(record["format"], record["algorithm"])
        return {role: {"bytes": int(files[role]["bytes"]), "checksum": str(files[role]["checksum"])} for role in _ROLES}
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise DataError(
            f"{path} is not a checksum file this version reads ({type(error).__name__}); re-run "
            "tools/preprocess_data.py to rewrite it, or pass --no-data-checksum to skip the check."
        ) from None


def verify_checksums(prefix: str, bin_file: str, idx_file: str) -> bool:
    """True when PREFIX.checksum.json exists and both files match it; False when there is none
    (data preprocessed before checksums were recorded). A file that changed is a DataError that
    names it and the two ways on. The small .idx is read first, and a file whose size changed is
    refused without being read."""
    path = checksum_path(prefix)
    if not os.path.isfile(path):
        return False
    recorded = _recorded(path)
    for role, data_file in (("idx", idx_file), ("bin", bin_file)):
        expected = (recorded[role]["bytes"], recorded[role]["checksum"])
        if os.path.getsize(data_file) != expected[0] or _checksum(data_file, progress=True) != expected:
            raise DataError(
                f"{data_file} changed since preprocessing (its checksum no longer matches the one in {path}), "
                "so its tokens may be damaged; re-run tools/preprocess_data.py, or pass --no-data-checksum "
                "to use the data as it is."
            )
    return True
