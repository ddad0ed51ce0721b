"""--async-save (megatron/checkpoint/async_save.py): the files are byte for byte a synchronous
save's on 1 and 2 ranks; training goes on while they are written and `latest` moves only after;
a second save waits for the one in flight and says so; a background write that fails (a full disk,
an I/O error) stops the run with one sentence and leaves the previous checkpoint as `latest`; the
end of the run, --exit-interval and a NaN stop wait for the save in flight. The kills at every step
of an async save are in test_checkpoint_faults.py."""

import errno
import hashlib
import multiprocessing
import os
import re
import signal
import time
from multiprocessing.sharedctypes import Synchronized
from pathlib import Path

import pytest
import torch
import torch._dynamo  # torch's optimizers import it at their first: once here, not in every forked rank
import torch.distributed as dist
from safetensors.torch import load_file

import megatron.checkpoint.async_save as async_save_module
import megatron.checkpoint.save as save_module
from megatron.checkpoint.iterations import read_latest
from megatron.checkpoint.layout import LATEST_FILE, MANIFEST_FILE
from megatron.errors import CheckpointError, TrainingStopped
from megatron.parallel import build_parallel_grid, free_port, single_process_grid
from megatron.training.loop import Trainer
from tests.dist_utils import run_distributed
from tests.save_protocol import count_protocol_steps
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
    assert written >= 0.9 and waited < written / 2  # three slow files written while training went on
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


def _pair_rank(rank: int, port: int, corpus: str, folder: str, kill_rank: int, kill_at: int | None) -> None:
    """One of two ranks training in `folder` (resuming from it) with --async-save, rank `kill_rank`
    SIGKILLing itself at its protocol call `kill_at` (None: never)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    if rank == kill_rank and kill_at is not None:
        count_protocol_steps(kill_at, [])
    config = tiny_config(corpus, 2, train_iters=4, save=folder, load=folder, save_interval=2, async_save=True,
                         global_batch_size=8, log_interval=100, eval_interval=100)  # fmt: skip
    Trainer(config, build_parallel_grid(torch.device("cpu"))).train()
    dist.destroy_process_group()


def _run_pair(corpus: str, folder: Path, kill_rank: int = 0, kill_at: int | None = None) -> bool:
    """Two forked ranks; once one is killed the other is too. True when the kill happened."""
    context, port = multiprocessing.get_context("fork"), free_port()
    ranks = [
        context.Process(target=_pair_rank, args=(rank, port, corpus, str(folder), kill_rank, kill_at))
        for rank in range(2)
    ]
    for process in ranks:
        process.start()
    deadline = time.monotonic() + 120
    while any(p.exitcode is None for p in ranks) and time.monotonic() < deadline:
        if any(p.exitcode == -signal.SIGKILL for p in ranks):
            for process in ranks:
                if process.exitcode is None:
                    process.kill()  # as a scheduler ends a job one of whose ranks died
        time.sleep(0.02)
    for process in ranks:
        process.join(timeout=10)
    codes = [p.exitcode for p in ranks]
    killed = -signal.SIGKILL in codes
    # a rank whose peer died may fail in its next collective first
    assert all(code in ((0, 1, -signal.SIGKILL) if killed else (0,)) for code in codes), f"the ranks ended with {codes}"
    return killed


def _count_rank(rank: int, port: int, corpus: str, folder: str, counting: int, calls: "Synchronized[int]") -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    counted: list[int] = []
    if rank == counting:
        count_protocol_steps(None, counted)
    config = tiny_config(corpus, 2, train_iters=4, save=folder, save_interval=2, async_save=True,
                         global_batch_size=8, log_interval=100, eval_interval=100)  # fmt: skip
    Trainer(config, build_parallel_grid(torch.device("cpu"))).train()
    dist.destroy_process_group()
    if rank == counting:
        calls.value = len(counted)


def _protocol_calls_per_save(corpus: str, folder: Path, rank: int) -> int:
    """Rank `rank`'s protocol calls in one save of the pair: half of a run's two (after the reference
    run, so that the dataset's index is built and no call of building it counts)."""
    context, port = multiprocessing.get_context("fork"), free_port()
    calls = context.Value("i", 0)
    ranks = [context.Process(target=_count_rank, args=(r, port, corpus, str(folder), rank, calls)) for r in range(2)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=120)
    assert [p.exitcode for p in ranks] == [0, 0] and calls.value % 2 == 0
    return calls.value // 2


@pytest.mark.parametrize("kill_rank", [0, 1])
def test_on_two_ranks_a_kill_at_every_step_of_an_async_save_twice_loses_nothing(corpus, tmp_path, kill_rank):
    reference = tmp_path / "reference"
    _run_pair(corpus, reference)
    per_save = _protocol_calls_per_save(corpus, tmp_path / "count", kill_rank)
    assert per_save >= (10 if kill_rank == 0 else 2)  # rank 1 writes its rng file alone at ZeRO stage 0
    for step in range(1, per_save + 1):
        folder = tmp_path / f"kill{step}"
        assert _run_pair(corpus, folder, kill_rank, per_save + step)  # dies in its second save
        _run_pair(corpus, folder, kill_rank, step)  # and again in the first save after the resume
        latest = read_latest(str(folder))[0]
        assert latest is None or (folder / f"iter_{latest:07d}" / MANIFEST_FILE).is_file(), f"killed at step {step}"
        assert not _run_pair(corpus, folder)  # the resumed run to the end
        for name in ("model_rank00000.safetensors", "optimizer_rank00000.safetensors"):
            # a resumed optimizer lists its state in another order: the tensors, not the bytes
            resumed, expected = (load_file(str(run / "iter_0000004" / name)) for run in (folder, reference))
            assert resumed.keys() == expected.keys(), f"killed at step {step}: {name}"
            assert all(torch.equal(resumed[key], expected[key]) for key in expected), f"killed at step {step}: {name}"


def test_an_overlapped_copy_is_waited_for_by_the_update_and_the_files_stay_exact(corpus, tmp_path, monkeypatch, capsys):
    """Under ZeRO stage 0 the writer copies the state while the next forward and backward run; with
    the copy slowed past them, the update must wait or it would change what is being copied."""
    real = async_save_module.host_copy

    def slow_copy(state):
        time.sleep(0.5)
        return real(state)

    monkeypatch.setattr(async_save_module, "host_copy", slow_copy)
    Trainer(
        tiny_config(corpus, train_iters=6, save=str(tmp_path / "async"), save_interval=2, async_save=True), SINGLE
    ).train()
    monkeypatch.undo()
    Trainer(tiny_config(corpus, train_iters=6, save=str(tmp_path / "sync"), save_interval=2), SINGLE).train()
    assert _digests(tmp_path / "async") == _digests(tmp_path / "sync")
    waited = [float(w) for w in re.findall(r"training waited ([0-9.]+) s for the copy", capsys.readouterr().out)]
    assert len(waited) == 3 and min(waited[:2]) > 0.3  # the update of the next iteration waited for the copy


def test_a_nan_in_an_overlapped_copy_is_never_saved_and_latest_never_moves(corpus, tmp_path):
    save = tmp_path / "ckpt"
    config = tiny_config(corpus, train_iters=4, save=str(save), save_interval=2, async_save=True,
                         no_check_for_nan_in_loss_and_grad=True)  # fmt: skip
    trainer = Trainer(config, SINGLE)
    with torch.no_grad():  # a weight that is NaN from the start: every step is skipped and it stays NaN
        next(trainer.engine.module.parameters()).view(-1)[0] = float("nan")
    with pytest.raises(CheckpointError, match=r"holds a NaN or an infinity on rank 0, so .*iter_0000002 was not written "
                       "and the latest checkpoint is unchanged"):  # fmt: skip
        trainer.train()
    assert sorted(p.name for p in save.iterdir()) == []
