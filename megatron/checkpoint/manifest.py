"""The manifest: the one metadata file of a checkpoint (format 2). It is typed and versioned and says
what the run was (iteration, consumed samples and tokens, the model config, the tokenizer, the log
window between two lines), the whole parallel layout, the engine's state (counters, optimizer groups,
LR schedule, loss scale, how tensor-parallel tensors were split) and every file of the checkpoint
with its size and checksum (checksum.py says which and why). No flag spelling is recorded: renaming
a flag cannot break a checkpoint. Folders saved in format 1 (a manifest and engine.json) or before
manifests (engine.json alone) are read into the same records by format1.py.
"""

import json
import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from megatron.checkpoint.checksum import bytes_checksum, file_checksum
from megatron.checkpoint.layout import MANIFEST_FILE
from megatron.checkpoint.model_record import ModelConfigField
from megatron.errors import CheckpointError
from megatron.tokenizer_spec import TokenizerSpec

FORMAT_VERSION = 2
PRE_MANIFEST_FORMAT = 0  # the record of a folder saved before manifests existed: nothing to verify


class DamagedCheckpoint(CheckpointError):
    """A checkpoint folder whose manifest or files do not check out."""


class StrictRecord(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class FileRecord(StrictRecord):
    size: int
    checksum: str


class LogWindowRecord(StrictRecord):
    """The iterations since the last training line: every rank's loss terms of each (`Losses`
    order) and how many skipped their step, so the first line after a resume averages the same."""

    losses: list[list[list[float]]]
    skipped: int


class RunRecord(StrictRecord):
    """What the training loop (or an import) adds: None for a checkpoint saved through the engine alone."""

    iteration: int
    consumed_samples: int
    consumed_tokens: int
    model: ModelConfigField
    tokenizer: TokenizerSpec
    tokenizer_size: int | None = None  # its vocabulary, for people; None where not recorded
    log_window: LogWindowRecord | None = None
    training_data: list[str] | None = None  # the training data's prefix list (weights included), as given
    converted_from: str | None = None  # the Hugging Face folder an import read
    command_line: str = ""  # for people only: nothing reads it back


class LayoutRecord(StrictRecord):
    """The saving run's parallel sizes; None where a checkpoint saved before format 2 did not record one."""

    world_size: int | None
    tensor_parallel_size: int | None
    pipeline_parallel_size: int | None
    data_parallel_size: int | None
    expert_parallel_size: int | None
    expert_tensor_parallel_size: int | None


class EngineRecord(StrictRecord):
    """The engine's state besides its tensors. `client_state` is what a caller of the engine's
    `save_checkpoint(client_state=...)` passed (DeepSpeed's API); the training loop passes none."""

    global_steps: int
    micro_steps: int
    skipped_steps: int
    optimizer_groups: list[dict[str, Any]]
    lr_scheduler: dict[str, Any] | None
    loss_scaler: dict[str, Any] | None
    tensor_parallel_splits: dict[str, tuple[int, tuple[int, ...] | None]] = {}
    weights_only: bool = False  # no optimizer state (a Hugging Face import): the optimizer starts afresh
    client_state: dict[str, Any] = {}


def json_checksum(payload: dict[str, Any]) -> str:
    """The checksum of a manifest's JSON object without its `checksum`, in a canonical spelling, so
    that a reader checks it before it interprets a single field."""
    rest = {key: value for key, value in payload.items() if key != "checksum"}
    return bytes_checksum(json.dumps(rest, sort_keys=True, separators=(",", ":")).encode())


class Manifest(StrictRecord):
    """`checksum` is that of the manifest's own JSON without it, so a flip here is caught too."""

    format_version: int
    run: RunRecord | None
    layout: LayoutRecord
    engine: EngineRecord
    zero_stage: int | None  # None: saved before manifests
    precision: str | None
    files: dict[str, FileRecord]
    checksum: str = ""

    def own_checksum(self) -> str:
        return json_checksum(self.model_dump(mode="json"))


def file_record(path: Path) -> FileRecord:
    size, checksum = file_checksum(path)
    return FileRecord(size=size, checksum=checksum)


def write_manifest(folder: Path, manifest: Manifest) -> None:
    path = folder / MANIFEST_FILE
    with open(path, "w") as handle:
        handle.write(manifest.model_copy(update={"checksum": manifest.own_checksum()}).model_dump_json(indent=1))
        handle.flush()
        os.fsync(handle.fileno())


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
