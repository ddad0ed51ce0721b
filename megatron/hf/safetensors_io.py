"""safetensors files read and written one tensor at a time, so that converting a model never
holds more than a few of its tensors in memory.

Reading: `TensorIndex` takes every tensor's dtype and shape from the file headers (safe_open),
and reads a tensor's data only when asked for it, with pread(2) rather than a memory map.
Writing: the header of a file is known before any data is (the names, dtypes and shapes of what goes
in it), so `write_file` writes the header, then asks for each tensor in turn and writes its bytes,
checksumming them as they go by (for our
checkpoint's manifest).
"""

import json
import math
import os
import re
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from megatron.checkpoint.checksum import BlockSum
from megatron.errors import CheckpointError, ConfigError

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
CODES = {dtype: code for code, dtype in DTYPES.items()}
# what save_pretrained writes beside the shards of a model in several files
INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class TensorInfo:
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def meta(self) -> torch.Tensor:
        """A tensor of this dtype and shape without data, to work out what an operation makes of it."""
        return torch.empty(self.shape, dtype=self.dtype, device="meta")


def _open(path: Path) -> Any:
    """A file opened for reading tensors with pread(2), into memory of their own size only; a
    memory map would add the whole file to the process's data size (RLIMIT_DATA) under torch.
    safetensors before 0.8 has only memory maps."""
    try:
        return safe_open(str(path), framework="pt", backend="pread")
    except TypeError:
        return safe_open(str(path), framework="pt")


class TensorIndex:
    """The tensors of some safetensors files by name; use it as a context manager."""

    def __init__(self, files: list[Path]) -> None:
        self.info: dict[str, TensorInfo] = {}
        self.file_of: dict[str, Path] = {}
        self._handles: dict[Path, Any] = {}
        self._stack = ExitStack()
        try:
            for path in files:
                handle = self._handles[path] = self._stack.enter_context(_open(path))
                for name in handle.keys():
                    if name in self.info:
                        raise CheckpointError(
                            f"{name} is in both {self.file_of[name]} and {path}; remove the stray file from the folder"
                        )
                    piece = handle.get_slice(name)
                    if piece.get_dtype() not in DTYPES:
                        raise CheckpointError(
                            f"{name} in {path} has dtype {piece.get_dtype()}, which this converter "
                            f"does not read; convert it to one of {', '.join(DTYPES)} first"
                        )
                    self.info[name] = TensorInfo(DTYPES[piece.get_dtype()], tuple(piece.get_shape()))
                    self.file_of[name] = path
        except SafetensorError as error:
            self._stack.close()
            raise CheckpointError(
                f"a safetensors file among {files[0].parent} is damaged ({error}); replace it with an intact copy"
            ) from None
        except BaseException:
            self._stack.close()
            raise

    def read(self, name: str) -> torch.Tensor:
        try:
            return self._handles[self.file_of[name]].get_tensor(name)
        except SafetensorError as error:
            raise CheckpointError(
                f"{self.file_of[name]} is damaged ({error}); replace it with an intact copy"
            ) from None

    def __enter__(self) -> "TensorIndex":
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()


@dataclass(frozen=True)
class Planned:
    """A tensor to write: its name and what it will be."""

    name: str
    info: TensorInfo


def write_file(
    path: Path, entries: list[Planned], produce: Callable[[str], torch.Tensor], metadata: dict[str, str] | None = None
) -> tuple[int, str]:
    """Write `entries` (each made by `produce(name)` when its turn comes) as a safetensors file,
    flushed to the disk; returns its size and checksum (megatron/checkpoint/checksum.py)."""
    # wider dtypes first, each keeping the planned order, so every tensor starts aligned to its
    # element size (the header is padded to a multiple of 8, as the safetensors library does)
    ordered = sorted(entries, key=lambda entry: -entry.info.dtype.itemsize)
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for entry in ordered:
        header[entry.name] = {
            "dtype": CODES[entry.info.dtype],
            "shape": list(entry.info.shape),
            "data_offsets": [offset, offset + entry.info.nbytes],
        }
        offset += entry.info.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    checksum, size = BlockSum(), 0
    with open(path, "wb") as out:
        for piece in (len(text).to_bytes(8, "little"), text):
            out.write(piece)
            checksum.update(piece)
            size += len(piece)
        for entry in ordered:
            tensor = produce(entry.name)
            if tensor.dtype != entry.info.dtype or tuple(tensor.shape) != entry.info.shape:
                raise RuntimeError(
                    f"{entry.name} came out {tensor.dtype} {tuple(tensor.shape)}, planned "
                    f"{entry.info.dtype} {entry.info.shape}"
                )
            data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
            out.write(data)
            checksum.update(data)
            size += data.size
            del tensor, data
        out.flush()
        os.fsync(out.fileno())
    return size, checksum.hexdigest()


_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(text: str) -> int:
    """Bytes of a size as Hugging Face's max_shard_size writes it: "5GB" (10^9), "500MiB" (2^20), 1000000."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", text.upper())
    if not match or match.group(2) not in _UNITS or float(match.group(1)) * _UNITS[match.group(2)] < 1:
        raise ConfigError(
            f"--max-shard-size {text!r} is not a size; write it as Hugging Face does, e.g. 5GB, 500MB or 2GiB"
        )
    return int(float(match.group(1)) * _UNITS[match.group(2)])
