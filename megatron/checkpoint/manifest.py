"""The manifest: one typed, versioned file per checkpoint that says what the run was (iteration,
consumed samples and tokens, model config, tokenizer, parallel sizes, ZeRO stage, precision) and
lists every file of the checkpoint with its size and checksum (checksum.py says which and why).
"""

import json
import os
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, ValidationError

from megatron.checkpoint.checksum import bytes_checksum, file_checksum, tensors_file_checksum
from megatron.checkpoint.layout import MANIFEST_FILE
from megatron.errors import CheckpointError

FORMAT_VERSION = 1
# engine.json's record that the checkpoint's writer wrote a manifest too, so that one missing was
# deleted and the folder is refused; one without any of these keys was saved before manifests
# existed and loads unverified. Besides the mark (every save since it was added):
# tensor_parallel_splits (every training save since tensor-parallel checkpoints, which came after
# manifests) and weights_only (the Hugging Face importer, which wrote a manifest from the start).
MANIFEST_MARK = "manifest_format"
MANIFEST_WRITER_KEYS = (MANIFEST_MARK, "tensor_parallel_splits", "weights_only")


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class FileRecord(_Record):
    size: int
    checksum: str


class RunRecord(_Record):
    """What the training loop adds: None for a checkpoint saved through the engine alone."""

    iteration: int
    consumed_samples: int
    consumed_tokens: int
    model: dict[str, Any]
    tokenizer: dict[str, Any]


class Manifest(_Record):
    """`checksum` is that of the manifest's own JSON without it, so a flip here is caught too."""

    format_version: int
    run: RunRecord | None
    world_size: int
    data_parallel_size: int
    expert_parallel_size: int
    zero_stage: int
    precision: str
    files: dict[str, FileRecord]
    checksum: str = ""

    def own_checksum(self) -> str:
        return bytes_checksum(self.model_dump_json(exclude={"checksum"}).encode())


def file_record(path: Path) -> FileRecord:
    size, checksum = file_checksum(path)
    return FileRecord(size=size, checksum=checksum)


def tensors_record(path: Path, tensors: dict[str, torch.Tensor]) -> FileRecord:
    """The record of a safetensors file just written from `tensors`, without reading it back."""
    size, checksum = tensors_file_checksum(path, tensors)
    return FileRecord(size=size, checksum=checksum)


def write_manifest(folder: Path, manifest: Manifest) -> None:
    path = folder / MANIFEST_FILE
    with open(path, "w") as handle:
        handle.write(manifest.model_copy(update={"checksum": manifest.own_checksum()}).model_dump_json(indent=1))
        handle.flush()
        os.fsync(handle.fileno())


def read_manifest(folder: Path) -> Manifest | None:
    """The folder's manifest; None for a checkpoint saved before manifests existed."""
    path = folder / MANIFEST_FILE
    if not path.is_file():
        return None
    try:
        manifest = Manifest.model_validate(json.loads(path.read_bytes()))
    except (ValueError, ValidationError) as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        reason = str(error).splitlines()[0]
        raise CheckpointError(f"the manifest {path} is damaged ({reason})") from None
    if manifest.checksum != manifest.own_checksum():
        raise CheckpointError(f"the manifest {path} is damaged (its own checksum does not match)")
    if manifest.format_version > FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has checkpoint format {manifest.format_version} but this version reads up to "
            f"{FORMAT_VERSION}; load it with the newer toolkit that saved it"
        )
    return manifest


def file_problem(folder: Path, name: str, expected: FileRecord) -> str | None:
    """Why `folder/name` does not match its manifest record, or None when it does."""
    path = folder / name
    if not path.is_file():
        return f"{path} is missing"
    size = path.stat().st_size
    if size != expected.size:
        return f"{path} has {size:,} bytes but the manifest says {expected.size:,}"
    if file_record(path).checksum != expected.checksum:
        return f"{path} fails its checksum (its data changed after the save)"
    return None
