"""A Hugging Face model's safetensors files read one tensor at a time, so that converting a model
never holds more than a few of its tensors in memory (checkpoint/tensor_file.py writes them the
same way): `TensorIndex` takes every tensor's dtype and shape from the file headers (safe_open),
and reads a tensor's data only when asked for it, with pread(2) rather than a memory map.
"""

import re
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from megatron.checkpoint.tensor_file import DTYPES, TensorInfo
from megatron.errors import CheckpointError, ConfigError

# what save_pretrained writes beside the shards of a model in several files
INDEX_FILE = "model.safetensors.index.json"


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
