"""The swap folder of one rank of one run: `nvme_path/<run>/rank<R>/`.

The run's name is agreed by all ranks (rank 0's choice, broadcast), so two runs pointing at the
same nvme_path never share files. The folder is created if missing, checked for free space before
anything is written, and removed when the engine using it is dropped or the interpreter exits.

A process killed outright (SIGKILL, the OOM killer, a lost node) cannot remove its folder, so each
rank writes an owner record into its folder, and making a SwapFolder removes every other run's
folder under nvme_path whose owners are all gone, with one line each. An owner is the host name,
the boot, the pid namespace, the pid and the process's start time (a later process that got the
same pid started later). A run folder is kept while any owner may be running: alive here, on
another host (a shared filesystem: its processes cannot be seen from here) or in another pid
namespace (another container on this machine). A rank folder without a readable record belongs to
a rank between making its folder and writing the record (a moment), or to a run of a version that
wrote none, which rewrites its swap files every step: its run folder goes only once nothing in it
has changed for a day.
"""

import contextlib
import json
import os
import shutil
import socket
import time
import uuid
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path

import torch.distributed as dist

from megatron.errors import ConfigError
from megatron.runtime.swap.slots import SwapFile

OWNER_FILE = "owner.json"
UNRECORDED_AGE_S = 24 * 3600


@dataclass(frozen=True)
class Owner:
    host: str
    boot: str  # /proc/sys/kernel/random/boot_id
    pid_namespace: str
    pid: int
    started: int  # clock ticks after boot: field 22 of /proc/<pid>/stat


def start_time(pid: int) -> int | None:
    """When process `pid` started (clock ticks after boot), or None if there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # the fields after the command's name start at field 3


def this_process() -> Owner:
    pid = os.getpid()
    return Owner(
        socket.gethostname(),
        Path("/proc/sys/kernel/random/boot_id").read_text().strip(),
        os.readlink("/proc/self/ns/pid"),
        pid,
        start_time(pid),
    )


def read_owner(rank_folder: Path) -> Owner | None:
    try:
        return Owner(**json.loads((rank_folder / OWNER_FILE).read_text()))
    except (OSError, ValueError, TypeError):
        return None  # not written yet, never written (an older version), or torn


def may_be_running(owner: Owner, me: Owner) -> bool:
    """Whether `owner` may still be running, as far as process `me` can tell."""
    if owner.host != me.host:
        return True
    if owner.boot != me.boot:
        return False  # this machine has restarted since
    return owner.pid_namespace != me.pid_namespace or start_time(owner.pid) == owner.started


def why_stale(run_root: Path, me: Owner) -> str | None:
    """Why the run folder `run_root` can be removed, or None while it may be in use."""
    try:
        owners = [read_owner(rank_folder) for rank_folder in run_root.iterdir()]
        changed = max(path.stat().st_mtime for path in [run_root, *run_root.rglob("*")])
    except OSError:
        return None  # its owner or another rank is removing it
    if any(owner is not None and may_be_running(owner, me) for owner in owners):
        return None
    if None in owners or not owners:
        young = time.time() - changed < UNRECORDED_AGE_S
        return None if young else "that has no owner record and has not changed for a day"
    pids = sorted({owner.pid for owner in owners})
    if len(pids) == 1:
        return f"of a run whose process {pids[0]} is gone"
    return f"of a run whose processes {', '.join(map(str, pids))} are gone"


def remove_stale_runs(root: Path, keep: str, me: Owner) -> None:
    """Remove the run folders under `root`, other than `keep`, that no process uses any more."""
    for run_root in sorted(root.glob("run-*")):
        reason = None if run_root.name == keep else why_stale(run_root, me)
        if reason is None:
            continue
        claimed = run_root.with_name(f"removing-{run_root.name}")
        try:
            run_root.rename(claimed)  # one process wins; the others (ranks of one host) find it gone
        except OSError:
            continue
        shutil.rmtree(claimed, ignore_errors=True)
        print(f" > removed stale swap folder {run_root} {reason}", flush=True)
    for claimed in root.glob("removing-run-*"):  # left by a process that died while removing it
        shutil.rmtree(claimed, ignore_errors=True)


def run_name() -> str:
    """A name unique to this run, the same on every rank."""
    name = [f"run-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(name, src=0)
    return name[0]


def remove_folder(path: Path, run_root: Path) -> None:
    """Delete a rank's files, and the run's folder once no rank's folder is left in it."""
    shutil.rmtree(path, ignore_errors=True)
    with contextlib.suppress(OSError):  # another rank's folder is still there, or it is gone already
        run_root.rmdir()


class SwapFolder:
    def __init__(self, nvme_path: str | None, rank: int, key: str) -> None:
        """`key` is the config block that asked for the folder (offload_optimizer, offload_param)."""
        if not nvme_path:
            raise ConfigError(
                f"offload to nvme needs zero_optimization.{key}.nvme_path; set it to a folder on a fast local disk"
            )
        root = Path(nvme_path)
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ConfigError(
                f"cannot create the swap folder {root} ({error.strerror}); set nvme_path to a writable folder"
            ) from None
        self.root = root
        owner = this_process()
        name = run_name()
        remove_stale_runs(root, name, owner)
        self.run_root = root / name
        self.path = self.run_root / f"rank{rank}"
        self.path.mkdir(parents=True)
        # the files go when the engine that swaps through this folder is dropped, or at exit
        self.remove = weakref.finalize(self, remove_folder, self.path, self.run_root)
        (self.path / OWNER_FILE).write_text(json.dumps(asdict(owner)))

    def check_space(self, needed_bytes: int, what: str) -> None:
        """Stop before writing anything if the disk cannot hold `needed_bytes` more of `what`."""
        available = shutil.disk_usage(self.root).free
        if needed_bytes > available:
            raise ConfigError(
                f"the swap folder {self.root} needs {needed_bytes:,} bytes for this rank's {what} but its disk "
                f"has {available:,} free; free space or point nvme_path at a larger disk"
            )

    def file(self, name: str, nbytes: int, holds: str) -> SwapFile:
        """A swap file of `nbytes` bytes of `holds` in this folder (made by its first write)."""
        return SwapFile(os.fspath(self.path / name), nbytes, holds)
