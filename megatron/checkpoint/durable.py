"""Writes that survive a power loss: a file's data and the directory entry that names it are
flushed (fsync) before anything that depends on them, such as `latest`, moves."""

import os
from pathlib import Path


def fsync_path(path: Path) -> None:
    """Flush a file's data, or a directory's entries, to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_durably(source: Path, target: Path) -> None:
    """Rename `source` over `target` and flush the directory holding the new name."""
    os.replace(source, target)
    fsync_path(target.parent)


def write_text_durably(path: Path, text: str) -> None:
    """Replace `path` by `text` atomically: a reader sees the old or the new text, never a part."""
    staging = path.with_name(path.name + ".tmp")
    with open(staging, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    replace_durably(staging, path)
