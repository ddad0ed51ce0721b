"""The fast checkpoint writer (ds_config checkpoint.writer.type "fast", megatron/checkpoint/aio_writer.py):
its files are the buffered writer's byte for byte (staged through buffers far smaller than the
files, one or two, so that every write but the last is a whole buffer and the last an unaligned
tail) and plain safetensors; a training run that saves through it resumes exactly; a file system
without O_DIRECT gets buffered writes and one log line; a failed write stops the save with one
sentence, leaving the previous checkpoint; `decoupled` saves in the background."""

import errno
import hashlib
import json
import os
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from megatron.checkpoint.aio_writer import AioWriter
from megatron.checkpoint.iterations import read_latest
from megatron.checkpoint.layout import LATEST_FILE
from megatron.checkpoint.tensors import save_tensors
from megatron.errors import CheckpointError, ConfigError
from megatron.ops.aio import aio_handle
from megatron.parallel import single_process_grid
from megatron.runtime.config.schema import load_runtime_config
from megatron.training.loop import Trainer
from tests.training_fixtures import tiny_config, write_corpus

SINGLE = single_process_grid(torch.device("cpu"))
SETTINGS = {"block_size": 4096, "queue_depth": 4, "intra_op_parallelism": 2}


def _tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "weights": torch.randn(1000, 37, generator=generator),
        "half": torch.randn(333, generator=generator).to(torch.bfloat16),
        "ids": torch.arange(77, dtype=torch.int64),
        "empty": torch.zeros(0),
    }


@pytest.mark.parametrize("double", [False, True])
def test_the_files_are_the_buffered_writers_byte_for_byte_and_plain_safetensors(tmp_path, double):
    tensors, lines = _tensors(), []
    writer = AioWriter(SETTINGS, 8192, double, lines.append)
    buffered = save_tensors(tmp_path / "buffered.safetensors", tensors, {"kind": "test"})
    fast = save_tensors(tmp_path / "fast.safetensors", tensors, {"kind": "test"}, writer.open)
    assert (tmp_path / "fast.safetensors").read_bytes() == (tmp_path / "buffered.safetensors").read_bytes()
    assert fast == buffered and fast.size > 10 * 8192 and lines == []  # many buffers; this disk takes O_DIRECT
    with safe_open(str(tmp_path / "fast.safetensors"), "pt") as handle:
        assert handle.metadata() == {"kind": "test"}
        assert all(torch.equal(handle.get_tensor(name), tensor) for name, tensor in tensors.items())


def test_a_file_system_without_o_direct_gets_buffered_writes_and_one_line(tmp_path, monkeypatch):
    """As a file system that refuses O_DIRECT answers (EINVAL; tmpfs before Linux 6.6, some network
    file systems): injected, since this machine's tmpfs takes it."""
    real_open = os.open

    def refusing(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr("megatron.checkpoint.aio_writer.os.open", refusing)
    lines: list[str] = []
    writer = AioWriter(SETTINGS, 8192, True, lines.append)
    for name in ("a", "b"):
        save_tensors(tmp_path / f"{name}.safetensors", _tensors(), None, writer.open)
        save_tensors(tmp_path / f"{name}-buffered.safetensors", _tensors())
        assert (tmp_path / f"{name}.safetensors").read_bytes() == (
            tmp_path / f"{name}-buffered.safetensors"
        ).read_bytes()
    assert lines == [
        f" > checkpoint writes: the file system holding {tmp_path} refuses O_DIRECT, so the fast writer writes "
        "through the page cache there"
    ]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def _config(corpus: str, tmp_path: Path, writer: dict | None, **overrides):
    ds = tmp_path / f"ds{len(list(tmp_path.glob('ds*.json')))}.json"
    ds.write_text(json.dumps({"checkpoint": {"writer": writer}} if writer else {}))
    return tiny_config(corpus, train_iters=6, save_interval=3, deepspeed=True, deepspeed_config=str(ds), **overrides)


def _digests(folder: Path) -> dict[str, str]:
    return {f"{p.parent.name}/{p.name}": hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.glob("iter_*/*")}


def test_a_run_saving_through_it_writes_the_same_checkpoints_and_resumes_exactly(corpus, tmp_path):
    fast_writer = {"type": "fast", "io_buffer_size": 16384}
    python = Trainer(_config(corpus, tmp_path, {"type": "python"}, save=str(tmp_path / "python")), SINGLE)
    reference = python.train()
    fast = Trainer(_config(corpus, tmp_path, fast_writer, save=str(tmp_path / "fast")), SINGLE)
    assert fast.train().losses == reference.losses
    digests = _digests(tmp_path / "fast")
    assert len(digests) == 8 and digests == _digests(tmp_path / "python")
    # resumed from the fast writer's iteration 3, a run equals the uninterrupted one
    (tmp_path / "fast" / LATEST_FILE).write_text("3\n")
    resumed = Trainer(
        _config(corpus, tmp_path, fast_writer, save=str(tmp_path / "fast"), load=str(tmp_path / "fast")), SINGLE
    )
    assert resumed.train().losses == reference.losses[3:]


def test_a_failed_write_stops_the_save_with_one_sentence_and_keeps_latest(corpus, tmp_path, monkeypatch):
    real = aio_handle.async_pwrite

    def failing(self, buffer, *args, fd, **kwargs):
        if "iter_0000006" in os.readlink(f"/proc/self/fd/{fd}"):  # the second save's writes fail as a disk's would
            raise OSError(errno.EIO, "Input/output error", "injected")
        return real(self, buffer, *args, fd=fd, **kwargs)

    monkeypatch.setattr(aio_handle, "async_pwrite", failing)
    save = tmp_path / "ckpt"
    trainer = Trainer(_config(corpus, tmp_path, {"type": "fast", "io_buffer_size": 8192}, save=str(save)), SINGLE)
    with pytest.raises(CheckpointError, match=rf"saving {save}/iter_0000006 failed on rank 0 \(Input/output error\); "
                       "the partial folder was removed and earlier checkpoints are intact"):  # fmt: skip
        trainer.train()
    assert read_latest(str(save))[0] == 3 and sorted(p.name for p in save.iterdir()) == ["iter_0000003", LATEST_FILE]


def test_decoupled_saves_in_the_background(corpus, tmp_path, capsys):
    save = tmp_path / "ckpt"
    Trainer(_config(corpus, tmp_path, {"type": "fast", "decoupled": True}, save=str(save)), SINGLE).train()
    out = capsys.readouterr().out
    assert f" > saving checkpoint at iteration 3 to {save} in the background" in out
    assert read_latest(str(save))[0] == 6


@pytest.mark.parametrize(
    "writer, message",
    [
        ({"type": "mock"}, 'the mock checkpoint writer, which this toolkit does not build; use "fast" or "python"'),
        ({"io_multiplier": 2}, "multiplied checkpoint writes, which this toolkit does not build"),
        ({"data_parallel": "socket"}, "checkpoint writes split over data-parallel ranks, which this toolkit does not"),
        ({"type": "slow"}, "bad value 'slow' for 'checkpoint.writer.type'"),
        ({"io_buffer_size": 0}, "checkpoint.writer.io_buffer_size"),
    ],
)
def test_writer_keys_deepspeed_has_and_this_toolkit_does_not_are_refused_by_name(writer, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_runtime_config({"train_batch_size": 1, "checkpoint": {"writer": writer}}, 1)


def test_deepspeeds_writer_spellings_are_read_as_deepspeed_reads_them():
    config = load_runtime_config(
        {"train_batch_size": 1, "checkpoint": {"writer": {"type": "FAST", "io_buffer_size": 1e8}}}, 1
    )
    assert config.checkpoint.fast_writer and config.checkpoint.writer.io_buffer_size == 10**8
    assert not config.checkpoint.decoupled and load_runtime_config({"train_batch_size": 1}, 1).checkpoint.writer is None
