"""Output folders named in a config, checked before any work: a file where a folder must go stops
the run at config time instead of as a NotADirectoryError once training has started."""

from pathlib import Path


def blocking_file(folder: Path) -> Path | None:
    """The file that keeps `folder` from being a folder to write in: `folder` itself, or the
    nearest of its parents that exists, where that is not a folder (None: it is one, or can be made)."""
    for part in (folder, *folder.parents):
        if part.exists():
            return None if part.is_dir() else part
    return None
