"""The one writer of safetensors files, for training saves, imports and exports alike.

The header of a file is known before any data is (the names, dtypes and shapes of what goes in
it), so the header is written first, then each tensor is asked for in turn and its bytes written,
so that a conversion never holds more than a few tensors in memory. Each tensor's bytes are
checksummed (checksum.py, about 10-25 GB/s) just before they are written, so the file's record
comes without reading it back. Flushing to the disk is the caller's (a save fsyncs in a thread
beside the next write).
"""

import json
import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from megatron.checkpoint.checksum import BlockSum
from megatron.checkpoint.manifest import FileRecord

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


@dataclass(frozen=True)
class Planned:
    """A tensor to write: its name and what it will be."""

    name: str
    info: TensorInfo


def planned_of(tensors: dict[str, torch.Tensor]) -> list[Planned]:
    return [Planned(name, TensorInfo(tensor.dtype, tuple(tensor.shape))) for name, tensor in tensors.items()]


def _header(ordered: list[Planned], metadata: dict[str, str] | None) -> bytes:
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
    text += b" " * (-len(text) % 8)  # padded to a multiple of 8, as the safetensors library does
    return len(text).to_bytes(8, "little") + text


class Sink(Protocol):
    """Where a file's bytes go, in order (an open file, or aio_writer.AioFile)."""

    def write(self, data: np.ndarray) -> None: ...


# how a file of a given size is opened for writing: buffered (the default) or aio_writer.AioWriter.open
Opener = Callable[[Path, int], AbstractContextManager[Sink]]


def write_tensor_file(
    path: Path,
    entries: list[Planned],
    produce: Callable[[str], torch.Tensor],
    metadata: dict[str, str] | None = None,
    opener: Opener | None = None,
) -> FileRecord:
    """Write `entries` (each made by `produce(name)` when its turn comes) as the safetensors file
    `path`, not yet flushed to the disk; returns its size and checksum. `opener(path, size)` gives
    the sink (default: the file opened for buffered writing)."""
    # wider dtypes first, each keeping the planned order, so every tensor starts aligned to its element size
    ordered = sorted(entries, key=lambda entry: -entry.info.dtype.itemsize)
    head = np.frombuffer(bytearray(_header(ordered, metadata)), dtype=np.uint8)  # writable, for torch.from_numpy
    checksum, size = BlockSum(), head.size + sum(entry.info.nbytes for entry in ordered)
    with (opener or _buffered)(path, size) as out:
        out.write(head)
        checksum.update(head)
        for entry in ordered:
            tensor = produce(entry.name)
            if tensor.dtype != entry.info.dtype or tuple(tensor.shape) != entry.info.shape:
                raise RuntimeError(
                    f"{entry.name} came out {tensor.dtype} {tuple(tensor.shape)}, planned "
                    f"{entry.info.dtype} {entry.info.shape}"
                )
            data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
            checksum.update(data)  # while the bytes are in the cache, before the write moves them on
            out.write(data)
            del tensor, data
    return FileRecord(size=size, checksum=checksum.hexdigest())


def _buffered(path: Path, size: int) -> AbstractContextManager[Sink]:
    return open(path, "wb")
