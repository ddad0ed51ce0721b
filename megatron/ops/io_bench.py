"""Measuring the async-I/O op: sizes, folder checks, the `Workload` of buffers and files, and
`measure`, shared by `ds_io`, `ds_nvme_tune` (megatron/cli/) and the benchmarks. `Workload.run` and
benchmarks/aio.py time a pass alike: every request submitted, then one wait.
"""

import os
import re
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from megatron.errors import UserError

_SUFFIXES = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_NO_GDS = (
    "--gds: GPUDirect Storage is not available here (it needs a CUDA GPU, cuFile and a GDS-enabled file "
    "system): drop --gds."
)


def parse_size(text: str | int) -> int:
    """'400M' -> 419430400 (binary suffixes K, M, G; a bare number is bytes)."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)B?\s*", str(text), re.IGNORECASE)
    if not match or int(match[1]) == 0:
        raise UserError(f"size {text!r} is not a positive byte count: write it like 4096, 128K, 400M or 1G.")
    return int(match[1]) * _SUFFIXES[match[2].upper()]


def format_size(num_bytes: int) -> str:
    for suffix in ("G", "M", "K"):
        if num_bytes % _SUFFIXES[suffix] == 0:
            return f"{num_bytes // _SUFFIXES[suffix]}{suffix}"
    return str(num_bytes)


@dataclass(frozen=True)
class AioSettings:
    """The handle's constructor arguments; field order and names are those of a config's "aio" block."""

    block_size: int = 1048576
    queue_depth: int = 128
    intra_op_parallelism: int = 1
    single_submit: bool = False
    overlap_events: bool = False

    def describe(self) -> str:
        return (
            f"block_size={format_size(self.block_size)} queue_depth={self.queue_depth} "
            f"intra_op_parallelism={self.intra_op_parallelism} single_submit={self.single_submit} "
            f"overlap_events={self.overlap_events}"
        )


def handle_factory(gds: bool = False) -> Callable[..., Any]:
    """The op's handle class, imported late so that flag and folder errors need no built op."""
    try:
        from megatron.ops import aio
    except ImportError as exc:
        raise UserError(f"the async-I/O op is not built ({exc}): run `pip install -e .` in the repository.") from None
    if not gds:
        return aio.aio_handle
    try:  # where GDS is missing the handle builds but every method raises
        aio.gds_handle(**asdict(AioSettings())).get_block_size()
    except Exception:
        raise UserError(_NO_GDS) from None
    return aio.gds_handle


def resolve_device(gpu: bool, gds: bool = False) -> torch.device:
    if gds and not torch.cuda.is_available():
        raise UserError(_NO_GDS)
    if gpu and not torch.cuda.is_available():
        raise UserError("--gpu needs a CUDA GPU, and none is visible to torch here: drop --gpu to use CPU tensors.")
    return torch.device("cuda" if gpu or gds else "cpu")


def check_folder(folder: Path, needed_bytes: int, flag: str = "--folder") -> None:
    """Stop with one sentence before any I/O if the folder is missing, read-only or too small."""
    if not folder.is_dir():
        raise UserError(
            f"{flag} {folder} does not exist or is not a folder: create it or pass one on the drive to test."
        )
    probe = folder / f".ds_io_probe_{os.getpid()}"
    try:  # os.access says yes to root even on a read-only mount, so try a real write
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise UserError(f"{flag} {folder} is not writable ({exc.strerror}): pass a folder you can write to.") from None
    free = shutil.disk_usage(folder).free
    if free < needed_bytes:
        raise UserError(
            f"{flag} {folder} has {free / 2**30:.1f} GiB free but the test needs "
            f"{needed_bytes / 2**30:.1f} GiB: free space or lower --io_size."
        )


def drop_page_cache() -> bool:
    """`sync; echo 3 > /proc/sys/vm/drop_caches`; False where the kernel does not let us."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        return False
    return True


def fill_pattern(buffer: torch.Tensor) -> None:
    # Non-constant bytes (no drive can compress them away), but a 1 MiB pattern repeated: random_()
    # over 1 GiB takes seconds on two cores.
    pattern = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8).to(buffer.device)
    rows = buffer.numel() // pattern.numel()
    buffer[: rows * pattern.numel()].view(rows, -1).copy_(pattern)
    buffer[rows * pattern.numel() :].copy_(pattern[: buffer.numel() - rows * pattern.numel()])


class Workload:
    """`requests` equal uint8 buffers of io_size bytes in all, one file each in `folder`.

    Buffers come from one handle's new_cpu_locked_tensor when `locked`, and are reused by every
    handle measured on this workload. The files are removed on exit. Callers check the folder
    first (check_folder), so that a bad folder is reported before anything else.
    """

    def __init__(
        self,
        folder: Path,
        io_size: int,
        requests: int = 1,
        locked: bool = True,
        device: torch.device = torch.device("cpu"),
    ) -> None:
        if requests < 1 or io_size % requests:
            raise UserError(f"--requests {requests} must be at least 1 and divide --io_size {io_size} bytes.")
        self.io_size = io_size
        self.locked = locked and device.type == "cpu"
        self.device = device
        self.files = [folder / f"ds_io_{os.getpid()}_{i}.bin" for i in range(requests)]
        self.buffers: list[torch.Tensor] = []
        self._allocator: Any = None

    def __enter__(self) -> "Workload":
        size = self.io_size // len(self.files)
        if self.locked:
            self._allocator = handle_factory()(**asdict(AioSettings()))
            example = torch.empty(0, dtype=torch.uint8)
            self.buffers = [self._allocator.new_cpu_locked_tensor(size, example) for _ in self.files]
        else:
            self.buffers = [torch.empty(size, dtype=torch.uint8, device=self.device) for _ in self.files]
        for buffer in self.buffers:
            fill_pattern(buffer)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._allocator is not None:
            for buffer in self.buffers:
                self._allocator.free_cpu_locked_tensor(buffer)
        self.buffers = []
        for path in self.files:
            path.unlink(missing_ok=True)

    def prepare(self, read: bool) -> None:
        """Reads need the files written once; writes start from empty files."""
        handle = handle_factory()(**asdict(AioSettings()))
        for buffer, path in zip(self.buffers, self.files):
            if read:
                handle.sync_pwrite(buffer, str(path))
            else:
                path.write_bytes(b"")

    def run(self, handle: Any, read: bool, sequential: bool) -> float:
        """Seconds for one pass over all buffers: submit every request then wait once, or wait after each."""
        submit = handle.async_pread if read else handle.async_pwrite
        start = time.perf_counter()
        for buffer, path in zip(self.buffers, self.files):
            submit(buffer, str(path))
            if sequential:
                handle.wait()
        if not sequential:
            handle.wait()
        return time.perf_counter() - start


def measure(
    workload: Workload,
    settings: AioSettings,
    read: bool,
    loops: int = 3,
    warmup: int = 1,
    sequential: bool = False,
    flush_cache: bool = False,
    gds: bool = False,
) -> dict[str, Any]:
    """Time `loops` passes after `warmup` untimed ones; GB/s of each pass and their median."""
    handle = handle_factory(gds)(**asdict(settings))
    gbps = []
    for i in range(warmup + loops):
        if read and flush_cache:
            drop_page_cache()
        seconds = workload.run(handle, read, sequential)
        if i >= warmup:
            gbps.append(workload.io_size / seconds / 1e9)
    return {
        "op": "read" if read else "write",
        "io_size": workload.io_size,
        "requests": len(workload.files),
        "sequential_requests": sequential,
        "locked": workload.locked,
        "device": workload.device.type,
        "settings": asdict(settings),
        "gbps": statistics.median(gbps),
        "loops_gbps": gbps,
    }


def flush_or_warn(requested: bool) -> bool:
    """Whether reads will be cold: --flush_page_cache asked for it and the kernel lets us drop the cache."""
    flush = requested and drop_page_cache()
    if requested and not flush:
        print(
            "warning: cannot drop the page cache here (needs root and a writable /proc/sys); reads may be warm",
            file=sys.stderr,
        )
    return flush
