"""The swap folder of one rank of one run: `nvme_path/<run>/rank<R>/`.

The run's name is agreed by all ranks (rank 0's choice, broadcast), so two runs pointing at the
same nvme_path never share files. The folder is created if missing, checked for free space before
anything is written, and removed when the engine using it is dropped or the run ends.
"""

import os
import shutil
import time
import uuid
import weakref
from pathlib import Path

import torch.distributed as dist

from megatron.errors import ConfigError


def run_name() -> str:
    """A name unique to this run, the same on every rank."""
    name = [f"run-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(name, src=0)
    return name[0]


def remove_folder(path: Path, run_root: Path) -> None:
    """Delete a rank's files, and the run's folder once no rank's folder is left in it."""
    shutil.rmtree(path, ignore_errors=True)
    try:
        run_root.rmdir()
    except OSError:
        pass  # another rank's folder is still there, or it is gone already


class SwapFolder:
    def __init__(self, nvme_path: str | None, rank: int, key: str) -> None:
        """`key` is the config block that asked for the folder (offload_optimizer, offload_param)."""
        if not nvme_path:
            raise ConfigError(f"offload to nvme needs zero_optimization.{key}.nvme_path; "
                              "set it to a folder on a fast local disk")
        root = Path(nvme_path)
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ConfigError(f"cannot create the swap folder {root} ({error.strerror}); "
                              "set nvme_path to a writable folder") from None
        self.root = root
        self.run_root = root / run_name()
        self.path = self.run_root / f"rank{rank}"
        self.path.mkdir(parents=True)
        # the files go when the engine that swaps through this folder is dropped, or at exit
        self.remove = weakref.finalize(self, remove_folder, self.path, self.run_root)

    def check_space(self, needed_bytes: int, what: str) -> None:
        """Stop before writing anything if the disk cannot hold `needed_bytes` more of `what`."""
        available = shutil.disk_usage(self.root).free
        if needed_bytes > available:
            raise ConfigError(
                f"the swap folder {self.root} needs {needed_bytes:,} bytes for this rank's {what} but its disk "
                f"has {available:,} free; free space or point nvme_path at a larger disk"
            )

    def file(self, name: str) -> str:
        return os.fspath(self.path / name)
