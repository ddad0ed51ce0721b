"""Python face of the native async-I/O op (csrc/aio), with DeepNVMe's `aio_handle` API.

Tensors go to the extension as (address, byte count); this module checks them, keeps async
operands alive until `wait()`, stages CUDA tensors through locked host memory, and validates.

Return values follow DeepNVMe: a synchronous `sync_pread`/`sync_pwrite`/`pread`/`pwrite` returns
1 (the number of operations it completed), an asynchronous one returns 0, `read`/`write` return 0,
`wait()` returns the number of asynchronous operations it completed. Unlike DeepNVMe, failures are
never a -1 return: they raise OSError(errno, message, filename). A synchronous call neither waits
for nor reports earlier asynchronous operations; those belong to `wait()`.

As DeepNVMe's, `async_pwrite` also takes an open file descriptor in the file name's place, and
`is_pinned` says whether a tensor needs no bounce copy.

Memory that is not page-aligned (a plain `torch.empty` tensor) moves through each worker thread's
bounce ring one block at a time, every copy overlapping the disk transfers of the other blocks,
whatever `overlap_events` says: the defaults stay DeepNVMe's, and the flag keeps its meaning for
aligned memory (top the queue up after every completion instead of waiting for whole batches).
"""

import errno
import os
from typing import NamedTuple

import torch

try:
    from megatron.ops import _aio

    _IMPORT_ERROR = None
except ImportError as error:  # the extension is built by `pip install -e .`
    _aio = None
    _IMPORT_ERROR = error

ALIGNMENT = 4096
NOT_BUILT = (
    "The native async-I/O extension megatron.ops._aio is not built; run `pip install -e .` "
    "in the repository root (needs gcc, Python headers and pybind11)."
)


def extension():
    """The compiled module, or ImportError with the sentence that says how to build it."""
    if _aio is None:
        raise ImportError(NOT_BUILT) from _IMPORT_ERROR
    return _aio


def _positive(name, value):
    if int(value) <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _byte_view(tensor):
    """The tensor's bytes as a flat uint8 tensor sharing its memory."""
    return tensor.reshape(-1).view(torch.uint8)


class _Descriptor(NamedTuple):
    """A file descriptor the caller opened, standing where a file name would."""

    fd: int


class _LockedRegion(NamedTuple):
    buffer: object  # the extension's LockedBuffer: the memory lives while the handle holds it
    nbytes: int


class aio_handle:
    def __init__(
        self, block_size=1048576, queue_depth=128, single_submit=False, overlap_events=False, intra_op_parallelism=1
    ):
        self._block_size = _positive("block_size", block_size)
        self._queue_depth = _positive("queue_depth", queue_depth)
        self._single_submit = bool(single_submit)
        self._overlap_events = bool(overlap_events)
        self._intra_op_parallelism = _positive("intra_op_parallelism", intra_op_parallelism)
        self._impl = extension().Handle(
            self._block_size, self._queue_depth, self._single_submit, self._overlap_events, self._intra_op_parallelism
        )
        self._pending = []  # one (tensor, host tensor, finish callable or None) per async op
        self._locked = {}  # data_ptr -> _LockedRegion of tensors from new_cpu_locked_tensor

    def __del__(self):
        # The kernel may still be writing into pending tensors: they must outlive the I/O.
        if getattr(self, "_pending", None):
            self._impl.wait()

    # -- getters -------------------------------------------------------------------------------
    def get_block_size(self):
        return self._block_size

    def get_queue_depth(self):
        return self._queue_depth

    def get_single_submit(self):
        return self._single_submit

    def get_overlap_events(self):
        return self._overlap_events

    def get_intra_op_parallelism(self):
        return self._intra_op_parallelism

    def get_alignment(self):
        return ALIGNMENT

    # -- transfers -----------------------------------------------------------------------------
    def pread(self, buffer, filename, validate, async_op, file_offset=0):
        return self._transfer(True, buffer, filename, validate, async_op, file_offset)

    def pwrite(self, buffer, filename, validate, async_op, file_offset=0):
        return self._transfer(False, buffer, filename, validate, async_op, file_offset)

    def sync_pread(self, buffer, filename, file_offset=0):
        return self.pread(buffer, filename, False, False, file_offset)

    def sync_pwrite(self, buffer, filename, file_offset=0):
        return self.pwrite(buffer, filename, False, False, file_offset)

    def async_pread(self, buffer, filename, file_offset=0):
        return self.pread(buffer, filename, False, True, file_offset)

    def async_pwrite(
        self,
        buffer: torch.Tensor,
        filename: str | os.PathLike | int | None = None,
        file_offset: int = 0,
        *,
        fd: int | None = None,
    ) -> int:
        """Queue a write to `filename`, or, as DeepNVMe's overload, through `fd`: an int open for
        writing, given in filename's place or as fd=. The bytes land at file_offset (also with
        O_APPEND) and the file keeps what lies beyond; the caller may close fd once this returns."""
        if isinstance(filename, int) and not isinstance(filename, bool) and fd is None:
            filename, fd = None, filename
        if (filename is None) == (fd is None):
            raise TypeError("async_pwrite takes a file name or a file descriptor (fd=), exactly one")
        target = filename if fd is None else _Descriptor(int(fd))
        return self._transfer(False, buffer, target, False, True, file_offset)

    def read(self, buffer, filename, validate=False):
        self.pread(buffer, filename, validate, False)
        return 0

    def write(self, buffer, filename, validate=False):
        self.pwrite(buffer, filename, validate, False)
        return 0

    def wait(self):
        """Block until every async op finished; return their count or raise the first error."""
        pending, self._pending = self._pending, []
        results = self._impl.wait()
        first_error = None
        for (_tensor, _host, finish), result in zip(pending, results):
            try:
                if result is not None:
                    raise OSError(*result)
                if finish is not None:
                    finish()
            except OSError as error:
                first_error = first_error or error
        if first_error is not None:
            raise first_error
        return len(results)

    def _transfer(self, is_read, tensor, target, validate, async_op, file_offset):
        """Move the tensor's bytes to or from `target`: a file name, or a _Descriptor (never validated)."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
        if not tensor.is_contiguous():
            raise ValueError("aio_handle needs a contiguous tensor; call .contiguous() first")
        if int(file_offset) < 0:
            raise ValueError(f"file_offset must be >= 0, got {file_offset}")
        host = self._host_tensor(tensor, is_read)
        nbytes = host.numel() * host.element_size()
        if isinstance(target, _Descriptor):
            finish = self._finisher(is_read, tensor, host, None, int(file_offset), False)
            self._impl.transfer_fd(is_read, host.data_ptr(), nbytes, target.fd, int(file_offset), bool(async_op))
        else:
            path = os.fspath(target)
            finish = self._finisher(is_read, tensor, host, path, int(file_offset), validate)
            self._impl.transfer(is_read, host.data_ptr(), nbytes, path, int(file_offset), bool(async_op))
        if async_op:
            self._pending.append((tensor, host, finish))
            return 0
        if finish is not None:
            finish()
        return 1

    def _host_tensor(self, tensor, is_read):
        if tensor.device.type == "cpu":
            return tensor
        if tensor.device.type != "cuda":
            raise ValueError(f"aio_handle supports CPU and CUDA tensors, not {tensor.device}")
        # Device memory goes through a locked host bounce buffer.
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        if not is_read:
            host.copy_(tensor)
        return host

    def _finisher(self, is_read, tensor, host, path, file_offset, validate):
        """What must run after the I/O: copy a read back to the GPU, compare with the file."""
        steps = []
        if is_read and host is not tensor:
            steps.append(lambda: tensor.copy_(host))
        if validate:
            steps.append(lambda: _validate(host, path, file_offset))
        if not steps:
            return None
        return lambda: [step() for step in steps]

    # -- locked host memory --------------------------------------------------------------------
    def new_cpu_locked_tensor(self, num_elem, example_tensor):
        """A 1-D CPU tensor of example_tensor's dtype in 4096-aligned, mlock'd memory."""
        nbytes = int(num_elem) * example_tensor.element_size()
        buffer = extension().LockedBuffer(nbytes)
        tensor = torch.frombuffer(buffer, dtype=torch.uint8)[:nbytes].view(example_tensor.dtype)
        self._locked[tensor.data_ptr()] = _LockedRegion(buffer, nbytes)
        return tensor

    def free_cpu_locked_tensor(self, tensor):
        """Drop the handle's reference (the memory is freed once no tensor uses it any more) and
        return True; False, as DeepSpeed's handle, for a tensor this handle did not lock."""
        return self._locked.pop(tensor.data_ptr(), None) is not None

    def is_pinned(self, buffer: torch.Tensor) -> bool:
        """DeepNVMe's test for I/O without a bounce copy: a torch-pinned tensor, or a CPU tensor
        lying wholly inside one region from this handle's new_cpu_locked_tensor (views count too)."""
        if buffer.is_pinned():
            return True
        if buffer.device.type != "cpu":
            return False
        begin = buffer.data_ptr()
        end = begin + buffer.nbytes
        return any(start <= begin and end <= start + region.nbytes for start, region in self._locked.items())


def _validate(tensor, path, file_offset):
    """Re-read the bytes through ordinary buffered I/O and compare them with the tensor."""
    expected = _byte_view(tensor)
    actual = bytearray(expected.numel())
    view = memoryview(actual)
    with open(path, "rb") as file:
        file.seek(file_offset)
        got = 0
        while got < len(actual):
            count = file.readinto(view[got:])
            if not count:
                raise OSError(errno.EIO, f"validation re-read only {got} of {len(actual)} bytes", path)
            got += count
    if not actual:
        return
    differ = torch.frombuffer(actual, dtype=torch.uint8) != expected
    count = int(differ.sum())
    if count:
        first = int(differ.to(torch.uint8).argmax())
        raise OSError(
            errno.EIO,
            f"validation failed: {count} bytes differ from the file, the first at byte "
            f"{first} after file offset {file_offset}",
            path,
        )


class gds_handle:
    """GPUDirect Storage handle: same constructor as aio_handle; every method raises here."""

    def __init__(
        self, block_size=1048576, queue_depth=128, single_submit=False, overlap_events=False, intra_op_parallelism=1
    ):
        self._config = (block_size, queue_depth, single_submit, overlap_events, intra_op_parallelism)

    def __getattr__(self, name):
        if name.startswith("_") or not callable(getattr(aio_handle, name, None)):
            raise AttributeError(name)

        def unavailable(*args, **kwargs):
            raise RuntimeError(
                "GPUDirect Storage is not available on this machine: it needs a CUDA GPU, NVIDIA's "
                "cuFile library and a GDS-enabled file system; use aio_handle instead."
            )

        return unavailable
