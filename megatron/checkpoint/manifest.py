"""The manifest: one typed, versioned file per checkpoint that says what the run was (iteration,
consumed samples and tokens, model config, tokenizer, parallel sizes, ZeRO stage, precision) and
lists every file of the checkpoint with its size and CRC-32.

CRC-32 (zlib) because it is the fastest check in the standard library here (about 4 GB/s, against
1.8 for SHA-256 and 0.9 for BLAKE2b), catches every single-bit flip and every burst of up to 32
bits, and releases the GIL, so the save computes it in a thread while it writes the next file.
It guards against damage, not against tampering.
"""

import json
import os
import zlib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from megatron.checkpoint.durable import fsync_path
from megatron.checkpoint.layout import MANIFEST_FILE
from megatron.errors import CheckpointError

FORMAT_VERSION = 1
_CHUNK_BYTES = 16 << 20


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class FileRecord(_Record):
    size: int
    crc32: int


class RunRecord(_Record):
    """What the training loop adds: None for a checkpoint saved through the engine alone."""
    iteration: int
    consumed_samples: int
    consumed_tokens: int
    model: dict[str, Any]
    tokenizer: dict[str, Any]


class Manifest(_Record):
    """`checksum` is the CRC-32 of the manifest's own JSON without it, so a flip here is caught too."""
    format_version: int
    run: RunRecord | None
    world_size: int
    data_parallel_size: int
    expert_parallel_size: int
    zero_stage: int
    precision: str
    files: dict[str, FileRecord]
    checksum: int = 0

    def own_checksum(self) -> int:
        return zlib.crc32(self.model_dump_json(exclude={"checksum"}).encode())


def file_record(path: Path) -> FileRecord:
    """Size and CRC-32 of a file, read in chunks (zlib releases the GIL on each)."""
    crc, size = 0, 0
    with open(path, "rb", buffering=0) as handle:
        while chunk := handle.read(_CHUNK_BYTES):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return FileRecord(size=size, crc32=crc)


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
        raise CheckpointError(f"the manifest {path} is damaged (its own CRC-32 does not match)")
    if manifest.format_version > FORMAT_VERSION:
        raise CheckpointError(f"{path} has checkpoint format {manifest.format_version} but this version reads up to "
                              f"{FORMAT_VERSION}; load it with the newer toolkit that saved it")
    return manifest


def file_problem(folder: Path, name: str, expected: FileRecord) -> str | None:
    """Why `folder/name` does not match its manifest record, or None when it does."""
    path = folder / name
    if not path.is_file():
        return f"{path} is missing"
    size = path.stat().st_size
    if size != expected.size:
        return f"{path} has {size:,} bytes but the manifest says {expected.size:,}"
    if file_record(path).crc32 != expected.crc32:
        return f"{path} fails its CRC-32 check (its data changed after the save)"
    return None

