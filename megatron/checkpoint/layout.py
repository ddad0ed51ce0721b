"""Every name in a checkpoint directory, written once:

DIR/latest_checkpointed_iteration.txt   the iteration to resume from, moved last
DIR/iter_0000010/                        one checkpoint
    manifest.json                        format 2: the run, the layout, the engine's state, every file's checksum
                                         (format 1 had an engine.json beside it; format1.py reads both)
    model_rank00000.safetensors          tensors under global names (tensors.py), one file per writing rank
    optimizer_rank00000.safetensors      (and -1, -2, ... for each further 256 MiB)
    rng_rank00000.safetensors
    compression_rank00000.safetensors    1-bit optimizers' error feedback: each rank's own (with its place)
DIR/iter_0000010.tmp/                    a save in progress; a leftover one is removed
DIR/iter_0000010.old/                    the earlier save of the same iteration while a new one replaces it
"""

import re
from pathlib import Path

LATEST_FILE = "latest_checkpointed_iteration.txt"
MANIFEST_FILE = "manifest.json"
ENGINE_FILE = "engine.json"
MODEL, OPTIMIZER, RNG, COMPRESSION = "model", "optimizer", "rng", "compression"
STAGING_SUFFIX = ".tmp"
REPLACED_SUFFIX = ".old"

_TAG = re.compile(r"iter_(\d{7,})")


def iteration_tag(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def tag_iteration(name: str) -> int | None:
    """The iteration of a folder named `iter_N` (no suffix), else None."""
    match = _TAG.fullmatch(name)
    return int(match.group(1)) if match else None


def rank_file(stem: str, rank: int, part: int = 0) -> str:
    """A rank's file of `stem`; large state is cut into parts, `_rank00000-1.safetensors` on."""
    return f"{stem}_rank{rank:05d}{f'-{part}' if part else ''}.safetensors"


def rank_files(folder: Path, stem: str) -> list[Path]:
    return sorted(folder.glob(f"{stem}_rank*.safetensors"))


def staging_folder(final: Path) -> Path:
    return final.with_name(final.name + STAGING_SUFFIX)


def replaced_folder(final: Path) -> Path:
    return final.with_name(final.name + REPLACED_SUFFIX)
