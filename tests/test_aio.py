"""The native async-I/O op: round trips of every size and layout, and every error it must raise.

tmp_path is on the real disk (ext4 here), so the O_DIRECT path is the one under test; /dev/shm,
/dev/full and a 1 MiB tmpfs mount cover the buffered fallback and full disks.
"""

import errno
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.ops._aio", reason="the aio extension is not built: run `pip install -e .`")

from megatron.ops import aio
from megatron.ops.op_builder import AsyncIOBuilder, GDSBuilder

REPO = Path(__file__).resolve().parents[1]

MiB = 1 << 20
UINT8 = torch.empty(0, dtype=torch.uint8)


def random_bytes(nbytes, seed=0):
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def write_then_read(handle, tensor, path, file_offset=0, async_op=False):
    out = torch.zeros_like(tensor)
    if async_op:
        assert handle.async_pwrite(tensor, path, file_offset) == 0
        assert handle.wait() == 1
        assert handle.async_pread(out, path, file_offset) == 0
        assert handle.wait() == 1
    else:
        assert handle.sync_pwrite(tensor, path, file_offset) == 1
        assert handle.sync_pread(out, path, file_offset) == 1
    return out


@pytest.mark.parametrize("nbytes", [0, 1, 511, 4096, MiB + 7])
@pytest.mark.parametrize("file_offset", [0, 8192, 100])
@pytest.mark.parametrize("parallelism", [1, 4])
@pytest.mark.parametrize("async_op", [False, True])
def test_round_trip_bytes(tmp_path, nbytes, file_offset, parallelism, async_op):
    handle = aio.aio_handle(block_size=64 * 1024, intra_op_parallelism=parallelism)
    tensor = random_bytes(nbytes)
    path = tmp_path / "t.bin"
    assert torch.equal(write_then_read(handle, tensor, path, file_offset, async_op), tensor)
    assert path.stat().st_size == file_offset + nbytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("parallelism", [2, 3])
@pytest.mark.parametrize("locked", [False, True])
def test_round_trip_dtypes(tmp_path, dtype, parallelism, locked):
    handle = aio.aio_handle(
        block_size=128 * 1024,
        queue_depth=8,
        overlap_events=parallelism == 3,
        single_submit=parallelism == 2,
        intra_op_parallelism=parallelism,
    )
    values = torch.randn(MiB // 4 + 3).to(dtype) if dtype.is_floating_point else torch.arange(MiB // 4 + 3)
    tensor = handle.new_cpu_locked_tensor(values.numel(), values) if locked else values.clone()
    tensor.copy_(values)
    assert torch.equal(write_then_read(handle, tensor, tmp_path / "t.bin", file_offset=4096), values)


@pytest.mark.parametrize("locked", [False, True])
def test_round_trip_64_mib(tmp_path, locked):
    handle = aio.aio_handle(intra_op_parallelism=3, overlap_events=True)
    values = random_bytes(64 * MiB)
    tensor = handle.new_cpu_locked_tensor(values.numel(), values) if locked else values.clone()
    tensor.copy_(values)
    assert torch.equal(write_then_read(handle, tensor, tmp_path / "t.bin"), values)


def test_unaligned_memory_address(tmp_path):
    # A tensor starting 1 byte into a page is incongruent with every file offset: all bounce buffers.
    handle = aio.aio_handle(block_size=8192, queue_depth=4)
    base = handle.new_cpu_locked_tensor(3 * MiB, UINT8)
    tensor = base[1 : 2 * MiB + 1]
    tensor.copy_(random_bytes(tensor.numel()))
    assert torch.equal(write_then_read(handle, tensor, tmp_path / "t.bin", file_offset=4096), tensor)


def test_offset_write_keeps_neighbouring_bytes(tmp_path):
    handle = aio.aio_handle(intra_op_parallelism=2)
    path = tmp_path / "t.bin"
    original = random_bytes(3 * MiB, seed=1)
    handle.sync_pwrite(original, path)
    patch = random_bytes(MiB + 5, seed=2)
    handle.sync_pwrite(patch, path, file_offset=12345)
    expected = original.clone()
    expected[12345 : 12345 + patch.numel()] = patch
    assert torch.equal(torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8), expected)


def test_rewrite_with_shorter_tensor_leaves_exact_size(tmp_path):
    handle = aio.aio_handle()
    path = tmp_path / "t.bin"
    handle.write(random_bytes(2 * MiB + 3), path)
    shorter = random_bytes(5000, seed=3)
    assert handle.write(shorter, path) == 0
    assert path.stat().st_size == 5000
    assert path.read_bytes() == bytes(shorter.tolist())


def test_several_async_ops_then_one_wait(tmp_path):
    handle = aio.aio_handle(intra_op_parallelism=2)
    assert handle.wait() == 0
    tensors = [random_bytes(n, seed=n) for n in (10, 4096, MiB + 1, 3 * MiB)]
    for i, tensor in enumerate(tensors):
        handle.async_pwrite(tensor, tmp_path / f"{i}.bin")
    assert handle.wait() == len(tensors)
    outs = [torch.empty_like(t) for t in tensors]
    for i, out in enumerate(outs):
        handle.pread(out, tmp_path / f"{i}.bin", False, True)
    assert handle.wait() == len(tensors)
    assert all(torch.equal(a, b) for a, b in zip(tensors, outs))
    assert handle.wait() == 0


def test_deepnvme_tutorial_call(tmp_path):
    handle = AsyncIOBuilder().load().aio_handle(1024**2, 128, True, True, 1)
    assert (
        handle.get_block_size(),
        handle.get_queue_depth(),
        handle.get_single_submit(),
        handle.get_overlap_events(),
        handle.get_intra_op_parallelism(),
        handle.get_alignment(),
    ) == (1024**2, 128, True, True, 1, 4096)
    tensor = random_bytes(MiB)
    assert torch.equal(write_then_read(handle, tensor, tmp_path / "t.bin"), tensor)
    assert AsyncIOBuilder().is_compatible()


def test_locked_tensor_is_aligned_and_freed(tmp_path):
    handle = aio.aio_handle()
    tensor = handle.new_cpu_locked_tensor(1000, torch.empty(0, dtype=torch.float16))
    assert tensor.dtype == torch.float16 and tensor.numel() == 1000
    assert tensor.data_ptr() % handle.get_alignment() == 0
    assert handle.new_cpu_locked_tensor(0, UINT8).numel() == 0
    assert handle.free_cpu_locked_tensor(tensor) is True
    # DeepSpeed's handle answers False for a tensor it did not lock (freed already, or never locked)
    assert handle.free_cpu_locked_tensor(tensor) is False
    assert handle.free_cpu_locked_tensor(torch.zeros(4)) is False


def test_is_pinned_for_locked_memory_and_its_views_only():
    # DeepNVMe's meaning: no bounce copy needed, i.e. torch-pinned, or wholly inside a locked region
    handle = aio.aio_handle()
    locked = handle.new_cpu_locked_tensor(1000, torch.empty(0, dtype=torch.float32))
    assert handle.is_pinned(locked) is True
    assert handle.is_pinned(locked[10:20]) and handle.is_pinned(locked.view(torch.uint8)[1:])
    assert handle.is_pinned(locked.view(10, 100).t())  # a strided view of the same bytes
    assert handle.is_pinned(torch.zeros(1000)) is False
    assert handle.is_pinned(torch.zeros(0)) is False
    handle.free_cpu_locked_tensor(locked)
    assert handle.is_pinned(locked) is False  # no longer the handle's locked memory


@pytest.mark.cuda
def test_is_pinned_for_torch_pinned_and_cuda_tensors():
    handle = aio.aio_handle()
    assert handle.is_pinned(torch.empty(16, pin_memory=True)) is True
    assert handle.is_pinned(torch.empty(16, device="cuda")) is False


def _locked_kib():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmLck:"))


def test_large_locked_tensor_starts_on_a_huge_page_and_is_unmapped_when_freed(tmp_path):
    # 2 MiB and larger buffers are mapped on a 2 MiB boundary with MADV_HUGEPAGE (physically
    # contiguous memory: whole requests reach the disk); odd sizes must still round trip exactly.
    handle = aio.aio_handle()
    locked_before = _locked_kib()
    for nbytes in (2 * MiB, 3 * MiB + 5, 64 * MiB):
        tensor = handle.new_cpu_locked_tensor(nbytes, UINT8)
        assert tensor.numel() == nbytes and tensor.data_ptr() % (2 * MiB) == 0
        tensor.copy_(random_bytes(nbytes, seed=nbytes))
        out = handle.new_cpu_locked_tensor(nbytes, UINT8)
        assert handle.sync_pwrite(tensor, tmp_path / "t.bin") == 1
        assert handle.sync_pread(out, tmp_path / "t.bin") == 1
        assert torch.equal(out, tensor) and os.path.getsize(tmp_path / "t.bin") == nbytes
        handle.free_cpu_locked_tensor(tensor)
        handle.free_cpu_locked_tensor(out)
        del tensor, out
    assert _locked_kib() == locked_before  # every buffer was munlock'd and unmapped


@pytest.mark.parametrize("overlap_events", [False, True])
@pytest.mark.parametrize("parallelism,async_op", [(1, False), (2, True)])
def test_unaligned_tensor_through_the_bounce_arena(tmp_path, overlap_events, parallelism, async_op):
    # A tensor whose address is not page-aligned goes through the worker's bounce arena, slot by
    # slot, more requests than slots (its rings hold 4 MiB for reads, 32 MiB for writes), with small
    # and large blocks (blocks over 1 MiB are cut to 1 MiB there); the blocks stream through the
    # slots whatever overlap_events says.
    for block_size, queue_depth in ((4096, 8), (MiB, 128), (8 * MiB, 128)):
        handle = aio.aio_handle(
            block_size=block_size,
            queue_depth=queue_depth,
            overlap_events=overlap_events,
            intra_op_parallelism=parallelism,
        )
        tensor = random_bytes(80 * MiB + 3 + 1, seed=block_size)[1:]
        assert tensor.data_ptr() % 4096 != 0
        out = write_then_read(handle, tensor, tmp_path / "t.bin", file_offset=4096, async_op=async_op)
        assert torch.equal(out, tensor)


def test_validate_passes(tmp_path):
    handle = aio.aio_handle()
    tensor = random_bytes(MiB + 7)
    handle.pwrite(tensor, tmp_path / "t.bin", True, False, 100)
    out = torch.empty_like(tensor)
    handle.pread(out, tmp_path / "t.bin", True, False, 100)
    assert torch.equal(out, tensor)


def test_validate_detects_a_changed_file(tmp_path):
    # The read finishes in microseconds; the file then changes before wait() validates the tensor
    # against it, so the bytes read no longer match the file.
    handle = aio.aio_handle()
    path = tmp_path / "t.bin"
    data = random_bytes(4096)
    handle.write(data, path)
    out = torch.zeros(4096, dtype=torch.uint8)
    handle.pread(out, path, True, True)
    deadline = time.monotonic() + 30
    while not torch.equal(out, data) and time.monotonic() < deadline:  # the read has landed
        time.sleep(0.05)
    path.write_bytes(bytes(4096))
    with pytest.raises(OSError, match="validation failed") as raised:
        handle.wait()
    assert raised.value.errno == errno.EIO and raised.value.filename == str(path)


def open_for_write(path, flags=0):
    return os.open(path, os.O_WRONLY | os.O_CREAT | flags, 0o644)


@pytest.mark.parametrize("nbytes", [0, 511, 4096, MiB + 7])
@pytest.mark.parametrize("file_offset", [0, 8192, 100])
@pytest.mark.parametrize("parallelism", [1, 3])
def test_async_pwrite_through_a_file_descriptor(tmp_path, nbytes, file_offset, parallelism):
    # DeepNVMe's overload async_pwrite(buffer, fd, file_offset): the bytes land at file_offset and
    # the file keeps what lies before and beyond; the caller may close fd before wait().
    handle = aio.aio_handle(block_size=64 * 1024, intra_op_parallelism=parallelism)
    path = tmp_path / "t.bin"
    original = random_bytes(2 * MiB, seed=5)
    path.write_bytes(bytes(original.tolist()))
    tensor = random_bytes(nbytes, seed=nbytes)
    fd = open_for_write(path)
    assert handle.async_pwrite(tensor, fd, file_offset) == 0
    os.close(fd)
    assert handle.wait() == 1
    expected = bytearray(original.tolist())
    expected[file_offset : file_offset + nbytes] = bytes(tensor.tolist())
    assert path.read_bytes() == bytes(expected)
    out = torch.zeros_like(tensor)
    assert handle.sync_pread(out, path, file_offset) == 1 and torch.equal(out, tensor)


def test_fd_write_from_locked_memory_extends_the_file(tmp_path):
    handle = aio.aio_handle(intra_op_parallelism=2)
    path = tmp_path / "t.bin"
    tensor = handle.new_cpu_locked_tensor(3 * MiB, UINT8)
    tensor.copy_(random_bytes(3 * MiB, seed=6))
    fd = open_for_write(path)
    try:
        assert handle.async_pwrite(tensor, fd=fd, file_offset=4096) == 0  # DeepNVMe's keyword
        assert handle.wait() == 1
    finally:
        os.close(fd)
    data = path.read_bytes()
    assert len(data) == 4096 + 3 * MiB and data[:4096] == bytes(4096)
    assert data[4096:] == bytes(tensor.tolist())


def test_fd_with_deepspeeds_fast_writer_flags(tmp_path):
    # DeepSpeed's FastFileWriter opens with O_DIRECT (and later O_APPEND); the bytes still land at
    # file_offset, and an unaligned tail goes through buffered I/O beside the O_DIRECT descriptor.
    handle = aio.aio_handle()
    path = tmp_path / "t.bin"
    first, second = random_bytes(MiB, seed=7), random_bytes(MiB + 3, seed=8)
    fd = open_for_write(path, os.O_DIRECT)
    handle.async_pwrite(first, fd, 0)
    handle.wait()
    os.close(fd)
    fd = os.open(path, os.O_WRONLY | os.O_DIRECT | os.O_APPEND)
    handle.async_pwrite(second, fd, MiB)
    handle.wait()
    os.close(fd)
    assert path.read_bytes() == bytes(first.tolist()) + bytes(second.tolist())


@pytest.mark.parametrize("case", ["closed", "negative", "read_only"])
def test_bad_file_descriptor_raises_ebadf_before_any_io(tmp_path, case):
    # DeepSpeed hands a bad descriptor to io_submit unchecked (its assert aborts the process, or,
    # compiled out, wait() waits forever); here it is an OSError naming it, and nothing is queued.
    handle = aio.aio_handle()
    path = tmp_path / "t.bin"
    path.write_bytes(b"x" * 10)
    fd = {"closed": None, "negative": -1, "read_only": os.open(path, os.O_RDONLY)}[case]
    if fd is None:
        fd = os.open(path, os.O_WRONLY)
        os.close(fd)
    try:
        with pytest.raises(OSError) as raised:
            handle.async_pwrite(random_bytes(4096), fd)
    finally:
        if case == "read_only":
            os.close(fd)
    assert raised.value.errno == errno.EBADF
    assert raised.value.filename.startswith(f"file descriptor {fd}")
    if case == "read_only":
        assert str(path) in raised.value.filename and "open for reading only" in str(raised.value)
    assert handle.wait() == 0
    assert path.read_bytes() == b"x" * 10


def test_fd_write_to_a_full_device_names_it():
    if not os.path.exists("/dev/full"):
        pytest.skip("/dev/full does not exist on this machine")
    handle = aio.aio_handle()
    fd = os.open("/dev/full", os.O_WRONLY)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # /dev/full refuses O_DIRECT
            handle.async_pwrite(random_bytes(MiB), fd)
        with pytest.raises(OSError) as raised:
            handle.wait()
    finally:
        os.close(fd)
    assert raised.value.errno == errno.ENOSPC and "/dev/full" in raised.value.filename


def test_async_pwrite_takes_one_target(tmp_path):
    handle = aio.aio_handle()
    with pytest.raises(TypeError, match="exactly one"):
        handle.async_pwrite(random_bytes(8), tmp_path / "t.bin", fd=3)
    with pytest.raises(TypeError, match="exactly one"):
        handle.async_pwrite(random_bytes(8))
    with pytest.raises(TypeError):  # as DeepNVMe's, only async_pwrite takes a descriptor
        handle.sync_pwrite(random_bytes(8), 3)
    assert handle.wait() == 0


def test_non_contiguous_tensor_is_rejected(tmp_path):
    handle = aio.aio_handle()
    with pytest.raises(ValueError, match="contiguous"):
        handle.sync_pwrite(torch.zeros(8, 8).t(), tmp_path / "t.bin")


@pytest.mark.parametrize("is_read", [True, False])
def test_missing_folder_raises_enoent(tmp_path, is_read):
    handle = aio.aio_handle()
    path = tmp_path / "no_such_dir" / "t.bin"
    call = handle.sync_pread if is_read else handle.sync_pwrite
    with pytest.raises(FileNotFoundError) as raised:
        call(torch.zeros(10, dtype=torch.uint8), path)
    assert raised.value.errno == errno.ENOENT and str(path) in str(raised.value)


def test_read_past_end_fails_before_any_io(tmp_path):
    handle = aio.aio_handle()
    path = tmp_path / "short.bin"
    path.write_bytes(b"x" * 100)
    out = torch.full((8192,), 7, dtype=torch.uint8)
    with pytest.raises(OSError) as raised:
        handle.sync_pread(out, path)
    assert raised.value.errno == errno.EINVAL and str(path) in str(raised.value)
    assert "has 100 bytes" in str(raised.value)
    assert bool((out == 7).all())  # nothing was read
    with pytest.raises(OSError, match="needs 150"):
        handle.sync_pread(torch.empty(100, dtype=torch.uint8), path, file_offset=50)


def test_full_device_raises_enospc_and_warns_once():
    if not os.path.exists("/dev/full"):
        pytest.skip("/dev/full does not exist on this machine")
    handle = aio.aio_handle()
    with pytest.warns(RuntimeWarning, match="/dev/full"), pytest.raises(OSError) as raised:
        handle.sync_pwrite(random_bytes(MiB), "/dev/full")
    assert raised.value.errno == errno.ENOSPC and "/dev/full" in str(raised.value)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle.async_pwrite(random_bytes(10), "/dev/full")
        with pytest.raises(OSError) as raised:
            handle.wait()
    assert not caught  # one warning per handle
    assert raised.value.errno == errno.ENOSPC


def test_full_file_system_raises_enospc_before_overwriting(tmp_path):
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount_point)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a 1 MiB tmpfs here (needs root): {mounted.stderr.strip()}")
    try:
        handle = aio.aio_handle()
        path = mount_point / "t.bin"
        kept = random_bytes(512 * 1024)
        handle.sync_pwrite(kept, path)
        with pytest.raises(OSError) as raised:
            handle.sync_pwrite(random_bytes(2 * MiB), path)
        assert raised.value.errno == errno.ENOSPC and str(path) in str(raised.value)
        assert path.read_bytes() == bytes(kept.tolist())
    finally:
        subprocess.run(["umount", str(mount_point)], check=True)


def test_tmpfs_round_trip():
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm on this machine")
    handle = aio.aio_handle(intra_op_parallelism=2)
    path = f"/dev/shm/megatron_aio_test_{os.getpid()}.bin"
    tensor = random_bytes(MiB + 7)
    try:
        # Kernels before 6.6 refuse O_DIRECT on tmpfs: the handle then warns and uses buffered I/O.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = write_then_read(handle, tensor, path, file_offset=100)
        assert torch.equal(out, tensor)
        assert all("tmpfs" in str(w.message) for w in caught)
    finally:
        os.remove(path)


def test_gds_handle_raises():
    handle = GDSBuilder().load().gds_handle(1024**2, 128, False, False, 1)
    with pytest.raises(RuntimeError, match="GPUDirect Storage is not available on this machine"):
        handle.sync_pread(torch.zeros(4), "x")
    assert not GDSBuilder().is_compatible()


MISSING_EXTENSION = """
import sys
sys.modules["megatron.ops._aio"] = None  # what Python finds where the extension was never built
from megatron.ops.op_builder import AsyncIOBuilder
assert not AsyncIOBuilder().is_compatible()
AsyncIOBuilder().load()
"""


def test_missing_extension_says_how_to_build():
    run = subprocess.run([sys.executable, "-c", MISSING_EXTENSION], capture_output=True, text=True, cwd=REPO)
    assert run.returncode == 1 and "ImportError" in run.stderr and "pip install -e ." in run.stderr, run.stderr


@pytest.mark.cuda
def test_cuda_tensor_round_trip(tmp_path):
    handle = aio.aio_handle()
    tensor = random_bytes(MiB + 7).cuda()
    out = torch.zeros_like(tensor)
    handle.sync_pwrite(tensor, tmp_path / "t.bin")
    handle.async_pread(out, tmp_path / "t.bin")
    handle.wait()
    assert torch.equal(out, tensor)
