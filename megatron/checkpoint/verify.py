"""Reading a checkpoint folder's record, of any format, and checking it before anything else is
read: the manifest, then every file's size and checksum (the ranks share the files), agreed by all
ranks. Every reader (resume, inference, distillation, upcycling, export) gets the folder's
format-2 record from here; format1.py reads the older folders into it."""

import json
from pathlib import Path

from pydantic import ValidationError

from megatron.checkpoint.format1 import ManifestV1, upgraded, wrote_manifest
from megatron.checkpoint.layout import ENGINE_FILE, MANIFEST_FILE, rank_files
from megatron.checkpoint.manifest import FORMAT_VERSION, DamagedCheckpoint, Manifest, file_problem, json_checksum
from megatron.checkpoint.model_record import UnfitModelConfig, unfit
from megatron.parallel import ParallelGrid


def _damaged(path: Path, reason: str) -> DamagedCheckpoint:
    return DamagedCheckpoint(f"the manifest {path} is damaged ({reason})")


def _parsed(folder: Path) -> Manifest | ManifestV1 | None:
    """The folder's manifest as its format wrote it, its own checksum checked; None without one
    (saved before manifests: refused where its engine.json says a manifest was written)."""
    path = folder / MANIFEST_FILE
    if not path.is_file():
        if (folder / ENGINE_FILE).is_file() and not wrote_manifest(folder / ENGINE_FILE):
            return None
        if (folder / ENGINE_FILE).is_file() or any(rank_files(folder, "model")):
            raise DamagedCheckpoint(
                f"{folder} has no {MANIFEST_FILE} although the version that saved it writes one, so its files "
                f"cannot be verified; put back its {MANIFEST_FILE} from a copy of the folder"
            )
        raise DamagedCheckpoint(f"{folder} has neither a manifest nor {ENGINE_FILE}: it is not a complete checkpoint")
    text = path.read_bytes()
    try:
        raw = json.loads(text)
        version = raw.get("format_version")
        if version != 1 and raw.get("checksum") != json_checksum(raw):
            raise _damaged(path, "its own checksum does not match")
        if isinstance(version, int) and version > FORMAT_VERSION:
            raise DamagedCheckpoint(
                f"{path} has checkpoint format {version} but this version reads up to "
                f"{FORMAT_VERSION}; load it with the newer toolkit that saved it"
            )
        manifest = ManifestV1.model_validate_json(text) if version == 1 else Manifest.model_validate_json(text)
    except (ValueError, AttributeError, ValidationError) as error:  # JSON errors are ValueErrors
        raise _damaged(path, str(error).splitlines()[0]) from None
    except UnfitModelConfig as error:
        raise unfit(path, error) from None
    # format 1's checksum is over its typed record; format 2's raw JSON was checked above, since its
    # typed record gains the defaults of fields added after it was saved
    if isinstance(manifest, ManifestV1) and manifest.checksum != manifest.own_checksum():
        raise _damaged(path, "its own checksum does not match")
    return manifest


def _record(folder: Path, parsed: Manifest | ManifestV1 | None) -> Manifest:
    return parsed if isinstance(parsed, Manifest) else upgraded(folder, parsed)


def read_checkpoint(folder: Path) -> Manifest:
    """The folder's record, without checking its files (verify_folder does)."""
    return _record(folder, _parsed(folder))


def verify_folder(folder: Path, grid: ParallelGrid) -> Manifest:
    """The folder's record once every file matches its manifest (`format_version` 0 for a folder
    saved before manifests, which has nothing to check); raises DamagedCheckpoint naming the first
    bad file otherwise. Every rank must call it."""
    parsed = _parsed(folder)
    if parsed is not None:
        names = sorted(parsed.files)[grid.rank :: grid.world_size]
        problems = [problem for name in names if (problem := file_problem(folder, name, parsed.files[name]))]
        found = [problem for rank_problems in grid.gather_from_all(problems) for problem in rank_problems]
        if found:
            raise DamagedCheckpoint(found[0])
    return _record(folder, parsed)
