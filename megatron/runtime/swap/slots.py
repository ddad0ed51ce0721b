"""Locked, aligned host buffers that move swapped tensors, and the error a failed transfer raises.

Each slot has its own read and write handle, so waiting for one transfer never waits for another
(`aio_handle.wait()` waits for everything its handle has in flight).
"""

from collections.abc import Callable
from typing import Any

import torch

from megatron.errors import UserError
from megatron.ops.aio import aio_handle
from megatron.runtime.config import AioConfig

ALIGN = 1024  # elements: 4 KiB of fp32, O_DIRECT's alignment


class SwapError(UserError):
    """Reading or writing a swap file failed (a disk error, a full disk)."""


def swap_failed(what: str, error: OSError) -> SwapError:
    return SwapError(f"swapping {what} failed ({error}); training stopped and the last checkpoint is intact; "
                     "check the swap disk and its free space")


def align_down(numel: int) -> int:
    return numel // ALIGN * ALIGN


def align_up(numel: int) -> int:
    return -(-numel // ALIGN) * ALIGN


class IoSlot:
    """One locked buffer of `numel` fp32 elements with its own read and write handles; `what`
    names the swapped state in errors."""

    def __init__(self, aio: AioConfig, numel: int, what: str) -> None:
        settings = aio.model_dump()
        self.reader, self.writer = aio_handle(**settings), aio_handle(**settings)
        self.buffer = self.reader.new_cpu_locked_tensor(numel, torch.empty(0, dtype=torch.float32))
        self.what = what
        self.reading = self.writing = False

    def transfer(self, call: Callable[..., Any], tensor: torch.Tensor, path: str, byte_offset: int = 0) -> None:
        """Run one read or write call of this slot's handles, turning an OSError into a SwapError."""
        try:
            call(tensor, path, byte_offset)
        except OSError as error:
            raise swap_failed(self.what, error) from None

    def start_read(self, tensor: torch.Tensor, path: str, byte_offset: int = 0) -> None:
        self.transfer(self.reader.async_pread, tensor, path, byte_offset)
        self.reading = True

    def start_write(self, tensor: torch.Tensor, path: str, byte_offset: int = 0) -> None:
        self.transfer(self.writer.async_pwrite, tensor, path, byte_offset)
        self.writing = True

    def finish_read(self) -> None:
        if self.reading:
            self.reading = False
            self._wait(self.reader)

    def finish_write(self) -> None:
        if self.writing:
            self.writing = False
            self._wait(self.writer)

    def _wait(self, handle: aio_handle) -> None:
        try:
            handle.wait()
        except OSError as error:
            raise swap_failed(self.what, error) from None
