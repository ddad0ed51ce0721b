"""--async-save (megatron/checkpoint/async_save.py): the files are byte for byte a synchronous
save's on 1 and 2 ranks; training goes on while they are written and `latest` moves only after;
a second save waits for the one in flight and says so; a background write that fails (a full disk,
an I/O error) stops the run with one sentence and leaves the previous checkpoint as `latest`; the
end of the run, --exit-interval and a NaN stop wait for the save in flight. The kills at every step
of an async save are in test_checkpoint_faults.py."""

import errno
import hashlib
import re
import time
from pathlib import Path

import pytest
import torch

import megatron.checkpoint.save as save_module
from megatron.checkpoint.iterations import read_latest
from megatron.checkpoint.layout import LATEST_FILE
from megatron.errors import CheckpointError, TrainingStopped
from megatron.parallel import build_parallel_grid, single_process_grid
from megatron.training.loop import Trainer
from tests.dist_utils import run_distributed
from tests.training_fixtures import poisoned_forward, tiny_config, write_corpus

SINGLE = single_process_grid(torch.device("cpu"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def _digests(folder: Path) -> dict[str, str]:
    return {
        f"{path.parent.name}/{path.name}": hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.glob("iter_*/*"))
    }


def _run_both(corpus: str, tmp: str, dp: int) -> dict[str, torch.Tensor]:
    grid = build_parallel_grid(torch.device("cpu")) if dp > 1 else SINGLE
    losses = {}
    for mode in ("sync", "async"):
        config = tiny_config(corpus, dp, train_iters=6, save=f"{tmp}/{mode}", save_interval=2,
                             async_save=mode == "async", global_batch_size=4 * dp)  # fmt: skip
        losses[mode] = torch.tensor(Trainer(config, grid).train().losses)
    return losses


@pytest.mark.parametrize("world", [1, 2])
def test_an_async_save_writes_a_synchronous_saves_files_byte_for_byte(corpus, tmp_path, world):
    results = run_distributed(_run_both, world, corpus, str(tmp_path), world) if world > 1 else None
    losses = results[0] if results else _run_both(corpus, str(tmp_path), 1)
    assert torch.equal(losses["sync"], losses["async"])
    sync, async_ = _digests(tmp_path / "sync"), _digests(tmp_path / "async")
    assert len(sync) == 3 * (3 + world) and sync == async_  # manifest, model, optimizer, each rank's rng
    assert read_latest(str(tmp_path / "async"))[0] == 6


@pytest.fixture
def slow_writes(monkeypatch):
    """Each tensor file of a save takes 0.3 s more to write."""
    real = save_module.save_tensors

    def slow(*args, **kwargs):
        time.sleep(0.3)
        return real(*args, **kwargs)

    monkeypatch.setattr(save_module, "save_tensors", slow)


def _lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if re.match(r" (iteration|> sav|> wait)", line)]


def test_training_goes_on_while_the_files_are_written_and_latest_moves_after(corpus, tmp_path, capsys, slow_writes):
    save = tmp_path / "ckpt"
    config = tiny_config(corpus, train_iters=8, save=str(save), save_interval=4, log_interval=1, async_save=True)
    Trainer(config, SINGLE).train()
    lines = _lines(capsys.readouterr().out)
    started = lines.index(f" > saving checkpoint at iteration 4 to {save} in the background")
    finished = next(i for i, line in enumerate(lines) if line.startswith(" > saved checkpoint at iteration 4 "))
    assert any(line.startswith(" iteration        5/") for line in lines[started:finished])  # trained meanwhile
    waited = float(re.search(r"training waited ([0-9.]+) s", lines[finished]).group(1))
    written = float(re.search(r"in ([0-9.]+) s in the background", lines[finished]).group(1))
    assert written >= 0.9 and waited < 0.2  # three slow files written while training went on
    assert sorted(p.name for p in save.iterdir()) == ["iter_0000004", "iter_0000008", LATEST_FILE]


def test_a_save_waits_for_the_one_in_flight_and_says_so(corpus, tmp_path, capsys, slow_writes):
    save = tmp_path / "ckpt"
    Trainer(tiny_config(corpus, train_iters=3, save=str(save), save_interval=1, async_save=True), SINGLE).train()
    out = capsys.readouterr().out
    assert "waiting for the checkpoint of iteration 1 to be written before saving iteration 2" in out
    assert sorted(p.name for p in save.iterdir()) == ["iter_0000001", "iter_0000002", "iter_0000003", LATEST_FILE]


@pytest.mark.parametrize("error, said", [(errno.ENOSPC, "No space left on device"), (errno.EIO, "Input/output error")])
def test_a_failed_background_write_stops_the_run_and_keeps_latest(corpus, tmp_path, monkeypatch, error, said):
    real, calls = save_module.save_tensors, []

    def failing(path, *args, **kwargs):
        calls.append(path)
        if "iter_0000004" in str(path):
            raise OSError(error, said)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(save_module, "save_tensors", failing)
    save = tmp_path / "ckpt"
    config = tiny_config(corpus, train_iters=8, save=str(save), save_interval=2, async_save=True)
    with pytest.raises(CheckpointError, match=f"saving {save}/iter_0000004 failed on rank 0 \\({said}\\); the partial "
                       "folder was removed and earlier checkpoints are intact"):  # fmt: skip
        Trainer(config, SINGLE).train()
    assert read_latest(str(save))[0] == 2
    assert sorted(p.name for p in save.iterdir()) == ["iter_0000002", LATEST_FILE]


def test_the_exit_interval_waits_for_the_save_in_flight_and_then_saves(corpus, tmp_path, capsys, slow_writes):
    save = tmp_path / "ckpt"
    config = tiny_config(corpus, train_iters=10, save=str(save), save_interval=2, exit_interval=3, async_save=True)
    result = Trainer(config, SINGLE).train()
    assert result.exit_reason == "--exit-interval 3" and read_latest(str(save))[0] == 3
    assert sorted(p.name for p in save.iterdir()) == ["iter_0000002", "iter_0000003", LATEST_FILE]
    assert f"exiting at iteration 3 of 10: --exit-interval 3; checkpoint {save}/iter_0000003" in capsys.readouterr().out


def test_a_nan_stop_finishes_the_save_in_flight_and_names_it(corpus, tmp_path, slow_writes):
    save = tmp_path / "ckpt"
    config = tiny_config(corpus, train_iters=8, save=str(save), save_interval=2, async_save=True)
    trainer = Trainer(config, SINGLE, forward=poisoned_forward(float("nan"), lambda e: e.global_steps == 2))
    with pytest.raises(TrainingStopped, match=r"iteration 3: .*\(last checkpoint: iteration 2\)"):
        trainer.train()
    assert read_latest(str(save))[0] == 2 and sorted(p.name for p in save.iterdir()) == ["iter_0000002", LATEST_FILE]
