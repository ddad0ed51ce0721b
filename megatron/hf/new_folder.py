"""The folder a conversion writes (--save), both ways: all of it or nothing.

1. refuse a --save that exists and is not empty (nothing is overwritten);
2. remove SAVE.tmp if a killed run left one (a kill skips every cleanup, and must not block the rerun);
3. refuse, before writing anything, a disk without room for the estimate of every file;
4. write everything under SAVE.tmp;
5. rename SAVE.tmp to SAVE and flush the directory holding it.
A failure in 4 (a full disk, a refused tensor, an interrupt) removes SAVE.tmp; a full disk then
reads as one sentence. So --save holds a finished conversion or does not exist.
"""

import errno
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from megatron.checkpoint.durable import replace_durably
from megatron.errors import CheckpointError

# added per file to the estimate: a small JSON file's size, a file's last block on the disk
FILE_ALLOWANCE = 64 << 10
FULL_DISK = (errno.ENOSPC, errno.EDQUOT)


def staging_of(out: Path) -> Path:
    return out.with_name(out.name + ".tmp")


def refuse_existing_target(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(
            f"--save {out} already exists and is not an empty folder; give a new folder, so that nothing is overwritten"
        )


def refuse_small_disk(out: Path, needed: int, what: str) -> None:
    """`what` ("the export") needs about `needed` bytes on the disk of `out`."""
    existing = next(parent for parent in (out, *out.parents) if parent.exists())
    free = shutil.disk_usage(existing).free
    if needed > free:
        raise CheckpointError(
            f"{what} needs about {needed:,} bytes but {existing}'s disk has {free:,} free; "
            "free space or give --save on a larger disk"
        )


@contextmanager
def new_folder(out: Path, needed: int, what: str, log: Callable[[str], None]) -> Iterator[Path]:
    """Steps 2-5 around the body, which writes into the folder yielded (SAVE.tmp)."""
    staging = staging_of(out)
    if staging.exists():  # first, so that the disk's free space counts what it held
        shutil.rmtree(staging)
        log(f" > removed {staging}, left by a conversion that was interrupted")
    refuse_small_disk(out, needed, what)
    staging.mkdir(parents=True)
    try:
        yield staging
        replace_durably(staging, out)  # over an empty --save folder too
    except BaseException as error:
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(error, OSError) and error.errno in FULL_DISK:
            raise CheckpointError(
                f"the disk of --save {out} filled up during {what} ({error.strerror}), so nothing was left there; "
                f"free space (it needs about {needed:,} bytes) or give --save on a larger disk"
            ) from None
        raise
