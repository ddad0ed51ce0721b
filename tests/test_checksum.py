"""The checkpoint checksum catches what disks do to files: every single-bit flip, zeroed and
swapped blocks, truncation; reading a file in chunks gives the checksum of its bytes, and the
tensor-file writer records the checksum of the bytes it wrote."""

import numpy as np
import pytest
import torch
from safetensors import safe_open

import megatron.checkpoint.checksum as checksum_module
from megatron.checkpoint.checksum import bytes_checksum, file_checksum
from megatron.checkpoint.tensor_file import planned_of, write_tensor_file


@pytest.fixture(scope="module")
def data() -> bytes:
    return np.random.default_rng(0).integers(0, 256, size=3 * 4096 + 100, dtype=np.uint8).tobytes()


def test_every_single_bit_flip_changes_the_checksum(data):
    original = bytes_checksum(data)
    buffer = bytearray(data)
    for bit in range(len(data) * 8):
        buffer[bit // 8] ^= 1 << bit % 8
        assert bytes_checksum(bytes(buffer)) != original, bit
        buffer[bit // 8] ^= 1 << bit % 8


def test_zeroed_swapped_and_cut_blocks_change_it(data):
    original = bytes_checksum(data)
    blocks = [data[i : i + 4096] for i in range(0, len(data), 4096)]
    assert bytes_checksum(blocks[1] + blocks[0] + b"".join(blocks[2:])) != original
    assert bytes_checksum(bytes(4096) + b"".join(blocks[1:])) != original
    assert bytes_checksum(data[:-1]) != original and bytes_checksum(data + b"\0") == original  # the size tells these


def test_a_file_read_in_chunks_has_the_checksum_of_its_bytes(data, tmp_path):
    path = tmp_path / "file"
    path.write_bytes(data)
    assert file_checksum(path, chunk_bytes=4096) == (len(data), bytes_checksum(data))  # the last chunk short
    assert file_checksum(path) == (len(data), bytes_checksum(data))  # one chunk


def test_pieces_of_any_length_give_the_checksum_of_their_concatenation(data):
    block_sum = checksum_module.BlockSum()
    for start, stop in ((0, 5), (5, 4096), (4096, 4097), (4097, 9000), (9000, len(data))):
        block_sum.update(data[start:stop])
    assert block_sum.hexdigest() == bytes_checksum(data)


def test_a_tensor_file_written_has_the_record_of_its_bytes_and_reads_back_in_safetensors(tmp_path):
    tensors = {"b": torch.randn(1000), "a": torch.randn(3, 77).bfloat16(), "c": torch.arange(5), "d": torch.ones(0)}
    path = tmp_path / "t.safetensors"
    record = write_tensor_file(path, planned_of(tensors), tensors.__getitem__, metadata={"format": "pt"})
    assert (record.size, record.checksum) == file_checksum(path)
    with safe_open(str(path), framework="pt") as handle:
        assert handle.metadata() == {"format": "pt"}
        assert set(handle.keys()) == set(tensors)
        for name, tensor in tensors.items():
            assert torch.equal(handle.get_tensor(name), tensor), name


def test_a_tensor_produced_other_than_planned_stops_the_write(tmp_path):
    planned = planned_of({"w": torch.zeros(4)})
    with pytest.raises(RuntimeError, match=r"w came out torch.float32 \(5,\), planned torch.float32 \(4,\)"):
        write_tensor_file(tmp_path / "t.safetensors", planned, lambda name: torch.zeros(5))
