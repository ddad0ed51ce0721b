"""FastPersist's checkpoint writes (DeepSpeed's `checkpoint.writer.type: fast`): a file's bytes go
through page-aligned, locked staging buffers to the async-I/O op (megatron/ops/aio.py), which
writes them with O_DIRECT in parallel requests (the ds_config `aio` block's block size, queue depth
and threads). With `io_buffer_double` the next buffer is filled, and its bytes checksummed by the
tensor-file writer, while the previous one is on the disk. The file is still the plain safetensors
file the buffered writer makes, byte for byte. Where the file system refuses O_DIRECT (tmpfs, some
network file systems) the files are written by the buffered writer, said once in the log."""

import errno
import os
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import numpy as np
import torch

from megatron.checkpoint.iterations import Log
from megatron.checkpoint.tensor_file import Sink
from megatron.ops.aio import aio_handle


class AioFile:
    """One file's writes: staged in the writer's buffers, each full buffer queued at its offset."""

    def __init__(self, writer: "AioWriter", fd: int) -> None:
        self.writer, self.fd = writer, fd
        self.current, self.fill, self.offset, self.in_flight = 0, 0, 0, False

    def write(self, data: np.ndarray) -> None:
        source, done = torch.from_numpy(data), 0
        while done < source.numel():
            buffer = self.writer.buffers[self.current]
            take = min(buffer.numel() - self.fill, source.numel() - done)
            buffer[self.fill : self.fill + take].copy_(source[done : done + take])
            self.fill, done = self.fill + take, done + take
            if self.fill == buffer.numel():
                self._queue()

    def _queue(self) -> None:
        if not self.fill:
            return
        handle = self.writer.handle
        if self.in_flight:  # the other buffer's write; with a single buffer, this one's before refilling it
            handle.wait()
        handle.async_pwrite(self.writer.buffers[self.current][: self.fill], fd=self.fd, file_offset=self.offset)
        self.in_flight, self.offset, self.fill = True, self.offset + self.fill, 0
        self.current = (self.current + 1) % len(self.writer.buffers)
        if len(self.writer.buffers) == 1:
            handle.wait()
            self.in_flight = False

    def finish(self) -> None:
        self._queue()
        if self.in_flight:
            self.in_flight = False
            self.writer.handle.wait()


class AioWriter:
    """One rank's checkpoint writer: its aio handle and staging buffers, reused for every file."""

    def __init__(self, handle_settings: dict[str, object], buffer_bytes: int, double: bool, log: Log) -> None:
        self.handle = aio_handle(**handle_settings)
        example = torch.empty(0, dtype=torch.uint8)
        self.buffers = [self.handle.new_cpu_locked_tensor(buffer_bytes, example) for _ in range(2 if double else 1)]
        self.log = log
        self.direct: dict[int, bool] = {}  # by device: whether its file system takes O_DIRECT

    @contextmanager
    def open(self, path: Path, size: int) -> Iterator[Sink]:
        """`path` as a file of `size` bytes written through the aio op (the tensor-file writer's
        opener), or through the page cache where the file system refuses O_DIRECT."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        if not self._takes_direct(path):
            os.close(fd)
            with open(path, "wb") as buffered:
                yield buffered
            return
        out = AioFile(self, fd)
        try:
            os.ftruncate(fd, size)
            yield out
            out.finish()
        finally:
            if out.in_flight:  # an error left a write queued: it must land before the buffer is reused
                with suppress(OSError):  # the error being raised already says what went wrong
                    self.handle.wait()
            os.close(fd)

    def _takes_direct(self, path: Path) -> bool:
        device = os.stat(path).st_dev
        if device not in self.direct:
            try:
                os.close(os.open(path, os.O_WRONLY | os.O_DIRECT | os.O_CLOEXEC))
                self.direct[device] = True
            except OSError as error:
                if error.errno != errno.EINVAL:
                    raise
                self.direct[device] = False
                self.log(
                    f" > checkpoint writes: the file system holding {path.parent} refuses O_DIRECT, so the fast "
                    "writer writes through the page cache there"
                )
        return self.direct[device]
