"""Checking a checkpoint folder before anything is read from it: its manifest, then every file's
size and checksum (the ranks share the files), agreed by all ranks. A folder saved before manifests
existed is accepted as it is, with its engine.json read as carefully; one whose engine.json says
its writer wrote a manifest (manifest.MANIFEST_WRITER_KEYS) is refused without it."""

import json
from pathlib import Path
from typing import Any

from megatron.checkpoint.layout import ENGINE_FILE, MANIFEST_FILE
from megatron.checkpoint.manifest import MANIFEST_WRITER_KEYS, Manifest, file_problem, read_manifest
from megatron.errors import CheckpointError
from megatron.parallel import ParallelGrid


class DamagedCheckpoint(CheckpointError):
    """A checkpoint folder whose manifest or files do not check out."""


def verify_folder(folder: Path, grid: ParallelGrid) -> Manifest | None:
    """The folder's manifest once every file matches it (None for a folder without one); raises
    DamagedCheckpoint naming the first bad file otherwise. Every rank must call it."""
    try:
        manifest = read_manifest(folder)
    except CheckpointError as error:
        raise DamagedCheckpoint(str(error)) from None
    if manifest is None:
        if not (folder / ENGINE_FILE).is_file():
            raise DamagedCheckpoint(
                f"{folder} has neither a manifest nor {ENGINE_FILE}: it is not a complete checkpoint"
            )
        if _wrote_manifest(folder / ENGINE_FILE):
            raise DamagedCheckpoint(
                f"{folder} has no {MANIFEST_FILE} although the version that saved it writes one, so its files "
                f"cannot be verified; put back its {MANIFEST_FILE} from a copy of the folder"
            )
        return None
    names = sorted(manifest.files)[grid.rank :: grid.world_size]
    problems = [problem for name in names if (problem := file_problem(folder, name, manifest.files[name]))]
    found = [problem for rank_problems in grid.gather_from_all(problems) for problem in rank_problems]
    if found:
        raise DamagedCheckpoint(found[0])
    return manifest


def _wrote_manifest(engine_file: Path) -> bool:
    """Whether engine.json records a writer of manifests (a damaged one is left to its reader)."""
    try:
        meta = json.loads(engine_file.read_bytes())
    except ValueError:
        return False
    return isinstance(meta, dict) and any(key in meta for key in MANIFEST_WRITER_KEYS)


def read_engine_meta(folder: Path) -> dict[str, Any]:
    """engine.json of a checkpoint folder, as a dict."""
    path = folder / ENGINE_FILE
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {folder} ({ENGINE_FILE} is missing); check --load and the iteration")
    try:
        meta = json.loads(path.read_bytes())
    except ValueError as error:
        raise DamagedCheckpoint(f"{path} is damaged ({error}); load an earlier checkpoint") from None
    if not isinstance(meta, dict):
        raise DamagedCheckpoint(f"{path} is damaged (it holds no JSON object); load an earlier checkpoint")
    return meta
