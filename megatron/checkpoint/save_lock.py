"""One writer per `--save` folder: a training run holds an `fcntl.flock` lock on `<save>/.lock`
for its whole life, so a second run pointed at the same folder is refused at start-up instead of
interleaving its saves with the first one's (and removing the first one's `.tmp` folder as a
"leftover" when it repairs the directory on load).

The first rank takes the lock: it is the rank that makes staging folders, repairs the directory
and moves `latest`, and there is one per run whatever the layout (the other ranks' writes all go
into folders it made). The kernel drops a flock when its process dies, so a lock file nobody holds
was left by a run that was killed; it is taken over with a log line naming that run. A run that
ends normally removes the file (while still holding the lock: see `acquire`). Tools that only read
checkpoints (generation, evaluation, export) never take it: a save appears in one rename, so a
reader sees whole checkpoints only.
"""

import fcntl
import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from megatron.errors import CheckpointError
from megatron.parallel import ParallelGrid

LOCK_FILE = ".lock"

Log = Callable[[str], None]


def _print(line: str) -> None:
    print(line, flush=True)


def _holder(text: str) -> tuple[str, str]:
    """(host, pid) named by a lock file's content; question marks for an unreadable one."""
    try:
        named = json.loads(text)
        return str(named["host"]), str(named["pid"])
    except (ValueError, KeyError, TypeError):
        return "?", "?"


def _content_of_holder(fd: int) -> str:
    """The holder writes its name just after it locks: give it a moment when it has not yet."""
    for _ in range(10):
        text = os.pread(fd, 4096, 0).decode(errors="replace")
        if text.strip():
            return text
        time.sleep(0.05)
    return text


@dataclass
class SaveLock:
    """A held lock on `path`; `release` gives it up and removes the file."""

    path: Path
    fd: int

    @classmethod
    def acquire(cls, save_dir: str | Path, log: Log = _print) -> "SaveLock":
        """Lock `save_dir` (made first if it does not exist yet), or raise CheckpointError naming
        the live run that holds it."""
        folder = Path(save_dir)
        path = folder / LOCK_FILE
        while True:
            try:
                folder.mkdir(parents=True, exist_ok=True)
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as error:
                raise CheckpointError(
                    f"cannot write into --save {folder} ({error.strerror or error}); "
                    "choose a folder this run can write to"
                ) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                host, pid = _holder(_content_of_holder(fd))
                os.close(fd)
                raise CheckpointError(
                    f"--save {folder} is in use by another training run (host {host}, pid {pid}, which holds "
                    f"{path}); wait for that run to end or choose another --save folder"
                ) from None
            except OSError as error:  # a file system without flock: say so rather than stop the run
                os.close(fd)
                log(
                    f" > WARNING: cannot lock {path} ({error.strerror}), so nothing stops a second run "
                    f"from saving into --save {folder} at the same time"
                )
                return cls(path, -1)
            # a holder that just ended removed the file after we opened it: our lock is on a file
            # nobody else will open, so start again on the one at `path` now
            try:
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            left = os.pread(fd, 4096, 0).decode(errors="replace")
            if left.strip():
                host, pid = _holder(left)
                log(f" > took over the lock {path} left by pid {pid} on host {host}, which ended without releasing it")
            mine = json.dumps({"host": socket.gethostname(), "pid": os.getpid()}).encode()
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, mine + b"\n", 0)
                os.fsync(fd)
            except OSError as error:  # a full disk, say: one sentence on every rank rather than a hang
                os.close(fd)
                raise CheckpointError(
                    f"cannot write {path} ({error.strerror or error}); free space there or choose another --save folder"
                ) from None
            return cls(path, fd)

    def release(self) -> None:
        if self.fd < 0:
            return
        # unlink before unlocking: a run waiting on this file then sees it is gone and starts again
        self.path.unlink(missing_ok=True)
        os.close(self.fd)  # closing drops the flock
        self.fd = -1


@contextmanager
def hold_save_lock(save_dir: str | None, grid: ParallelGrid, log: Log = _print) -> Iterator[None]:
    """Hold the lock on `save_dir` (nothing without one) on the first rank for the life of the
    block; every rank raises the same CheckpointError when another run holds it. Every rank must
    enter it."""
    lock, refused = None, None
    if save_dir and grid.is_first_rank:
        try:
            lock = SaveLock.acquire(save_dir, log)
        except CheckpointError as error:  # raised on every rank below, so none waits at a barrier
            refused = str(error)
    if save_dir:
        refused = grid.gather_from_all(refused)[0]  # the other ranks stop too, not hang at a barrier
    if refused:
        raise CheckpointError(refused)
    try:
        yield
    finally:
        if lock is not None:
            lock.release()
