"""Locked, aligned host buffers that move swapped tensors, the swap files they move them to, and
the error a failed or damaged transfer raises.

Each slot has its own read and write handle, so waiting for one transfer never waits for another
(`aio_handle.wait()` waits for everything its handle has in flight).

Integrity: a `SwapFile` keeps, in memory, a checksum of every 4 KiB block this rank wrote to it,
taken while the write is in flight; every read is checked against them once it has landed, so a
disk that hands back zeros, another block, an old version or flipped bits stops training instead
of feeding it wrong state. Per block, because a parameter file is written in sub-groups (by the
optimizer) and read in buckets (by the gathers), ranges that do not line up. A block's checksum is
the sum of its 512 64-bit words modulo 2**64: any change to one word (every single-bit flip, any
burst of up to 64 bits) changes it, and other content in a block (zeros, a stale or misplaced
block, random bytes) matches only by a 2**-64 chance; it misses two changes in one block that
cancel exactly, or words moved within one block, which lost, misplaced or torn writes, zeroed
blocks and bit rot do not make but by chance. It is the fastest full check here: ~27 GB/s on one
core (numpy), against ~4 GB/s for zlib.crc32 and ~9 GB/s for a position-weighted sum, and every
byte moved passes through it once. A block never written reads as zeros (a new, truncated file),
whose checksum is 0, so a file's first read is checked too.
"""

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from megatron.checkpoint.checksum import BLOCK_BYTES, block_sums
from megatron.errors import UserError
from megatron.ops.aio import aio_handle
from megatron.runtime.config.schema import AioConfig
from megatron.timers import timed

ALIGN = 1024  # elements: 4 KiB of fp32, O_DIRECT's alignment


class SwapError(UserError):
    """Reading or writing a swap file failed (a disk error, a full disk) or read back damaged data."""


def swap_failed(files: list["SwapFile"], error: OSError) -> SwapError:
    """The error for a failed transfer of `files`, named by what they hold."""
    what = " and ".join(sorted({file.holds for file in files}))
    return SwapError(
        f"swapping {what} failed ({error}); training stopped and the last checkpoint is intact; "
        "check the swap disk and its free space"
    )


def align_down(numel: int) -> int:
    return numel // ALIGN * ALIGN


def align_up(numel: int) -> int:
    return -(-numel // ALIGN) * ALIGN


def tensor_block_sums(data: torch.Tensor) -> np.ndarray:
    """The checksum of each 4 KiB block of the contiguous tensor `data`, the last block padded with zeros."""
    return block_sums(data.numpy().view(np.uint8))


class SwapFile:
    """A swap file of `nbytes` bytes and the checksum of each 4 KiB block this rank last wrote to it
    (swap files are not reused across runs, so the checksums need not outlive the process); `holds`
    names its contents in errors ("optimizer state", "parameter partitions"), whichever buffer
    moves it."""

    def __init__(self, path: str, nbytes: int, holds: str) -> None:
        self.path = path
        self.holds = holds
        self.sums = np.zeros(-(-nbytes // BLOCK_BYTES), dtype=np.uint64)  # unwritten blocks read as zeros

    def record(self, data: torch.Tensor, byte_offset: int) -> None:
        """`data` is being written at `byte_offset`, a multiple of 4 KiB. A piece that ends inside a
        block (a sub-group's moments) is always written and read whole, so the padded checksum of
        that block covers the same bytes both times."""
        sums = tensor_block_sums(data)
        first = byte_offset // BLOCK_BYTES
        self.sums[first : first + sums.size] = sums

    def check(self, data: torch.Tensor, byte_offset: int) -> None:
        """Raise a SwapError unless `data`, read from `byte_offset`, is what was last written there."""
        sums = tensor_block_sums(data)
        first = byte_offset // BLOCK_BYTES
        damaged = np.count_nonzero(sums != self.sums[first : first + sums.size])
        if damaged:
            end = byte_offset + data.nbytes
            raise SwapError(
                f"the swap disk returned damaged data for {self.holds} in {self.path}, bytes {byte_offset:,}-{end:,} "
                f"({damaged} of its {sums.size} 4 KiB blocks differ from what was written); training stopped and the "
                "last checkpoint is intact; check or replace the swap disk and resume from that checkpoint"
            )


class IoSlot:
    """One locked buffer of `numel` fp32 elements with its own read and write handles. Every read
    is checked when it is finished."""

    def __init__(self, aio: AioConfig, numel: int) -> None:
        settings = aio.handle_settings()
        self.reader, self.writer = aio_handle(**settings), aio_handle(**settings)
        self.buffer = self.reader.new_cpu_locked_tensor(numel, torch.empty(0, dtype=torch.float32))
        self.reads: list[tuple[torch.Tensor, SwapFile, int]] = []  # in flight, checked by finish_read
        self.writing: list[SwapFile] = []  # in flight, waited for by finish_write

    def _transfer(self, call: Callable[..., Any], tensor: torch.Tensor, file: SwapFile, byte_offset: int) -> None:
        """Run one read or write call of this slot's handles, turning an OSError into a SwapError."""
        try:
            call(tensor, file.path, byte_offset)
        except OSError as error:
            raise swap_failed([file], error) from None

    def start_read(self, tensor: torch.Tensor, file: SwapFile, byte_offset: int = 0) -> None:
        self._transfer(self.reader.async_pread, tensor, file, byte_offset)
        self.reads.append((tensor, file, byte_offset))

    def start_write(self, tensor: torch.Tensor, file: SwapFile, byte_offset: int = 0) -> None:
        self._transfer(self.writer.async_pwrite, tensor, file, byte_offset)
        self.writing.append(file)
        file.record(tensor, byte_offset)  # while the disk writes

    def write(self, tensor: torch.Tensor, file: SwapFile, byte_offset: int = 0) -> None:
        """Write `tensor` now, not through the async queue."""
        with timed("nvme-swap-write"):
            self._transfer(self.writer.sync_pwrite, tensor, file, byte_offset)
        file.record(tensor, byte_offset)

    def finish_read(self, before_check: Callable[[], None] | None = None) -> None:
        """Wait for the reads in flight, call `before_check` (to start the next transfer: the check
        takes a while), and check what they brought."""
        reads, self.reads = self.reads, []
        if reads:
            with timed("nvme-swap-read"):
                self._wait(self.reader, [file for _, file, _ in reads])
        if before_check is not None:
            before_check()
        for tensor, file, byte_offset in reads:
            file.check(tensor, byte_offset)

    def finish_write(self) -> None:
        writing, self.writing = self.writing, []
        if writing:
            with timed("nvme-swap-write"):
                self._wait(self.writer, writing)

    def _wait(self, handle: aio_handle, files: list[SwapFile]) -> None:
        try:
            handle.wait()
        except OSError as error:
            raise swap_failed(files, error) from None
