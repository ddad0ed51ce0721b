"""Faults around checkpoints, injected for real: SIGKILL at every step of the save protocol (twice
in a row), bit flips in every file kind, a damaged or missing `latest`, a full disk, checkpoints
saved before manifests existed, a manifest deleted from a checkpoint that had one."""

import json
import multiprocessing
import signal
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import megatron.checkpoint.save as save_module
from megatron.checkpoint.iterations import read_latest
from megatron.checkpoint.layout import LATEST_FILE, MANIFEST_FILE
from megatron.errors import CheckpointError
from megatron.parallel import single_process_grid
from megatron.training.loop import Trainer
from tests.save_protocol import PROTOCOL_STEPS, count_protocol_steps
from tests.training_fixtures import (
    FORMAT1_FLAGS,
    as_saved_before_manifests,
    format1_checkpoint,
    tiny_config,
    write_corpus,
)

SINGLE = single_process_grid(torch.device("cpu"))
ITERS, INTERVAL = 6, 2


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture
def one_thread():
    """Bit-for-bit comparisons across processes need the same reduction order in each."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _train_until_killed(
    corpus: str, folder: str, kill_at: int, made: "multiprocessing.sharedctypes.Synchronized", async_save: bool
) -> None:
    torch.set_num_threads(1)
    calls: list[int] = []
    count_protocol_steps(kill_at, calls)
    config = tiny_config(
        corpus, train_iters=ITERS, save=folder, load=folder, save_interval=INTERVAL, async_save=async_save
    )
    Trainer(config, SINGLE).train()
    made.value = len(calls)


def _killed_child(corpus: str, folder: Path, kill_at: int, async_save: bool) -> bool:
    """A forked child trains in `folder` (resuming from it) and dies at protocol call `kill_at`:
    True when it did, False when it finished making fewer calls than that."""
    context = multiprocessing.get_context("fork")
    made = context.Value("i", -1)
    child = context.Process(target=_train_until_killed, args=(corpus, str(folder), kill_at, made, async_save))
    child.start()
    child.join(timeout=120)
    assert child.exitcode == -signal.SIGKILL or (child.exitcode == 0 and made.value < kill_at), (
        f"the child ended with {child.exitcode} after {made.value} protocol calls"
    )
    return child.exitcode == -signal.SIGKILL


def _protocol_calls_per_save(corpus: str, tmp_path: Path, async_save: bool) -> int:
    calls: list[int] = []
    real = {(module, name): getattr(module, name) for module, name in PROTOCOL_STEPS}
    try:
        count_protocol_steps(None, calls)
        Trainer(
            tiny_config(
                corpus,
                train_iters=INTERVAL,
                lr_warmup_iters=1,
                save=str(tmp_path / "count"),
                save_interval=INTERVAL,
                async_save=async_save,
            ),
            SINGLE,
        ).train()
    finally:
        for (module, name), function in real.items():
            setattr(module, name, function)
    return len(calls)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_kill_at_every_step_of_the_save_twice_in_a_row_loses_nothing(corpus, tmp_path, one_thread, async_save):
    """--async-save too: its steps run in the writer thread and at the iteration that finishes it."""
    reference = Trainer(
        tiny_config(corpus, train_iters=ITERS, save=str(tmp_path / "full"), save_interval=INTERVAL), SINGLE
    )
    reference.train()
    per_save = _protocol_calls_per_save(corpus, tmp_path, async_save)
    assert per_save >= 8  # rng, model, optimizer (each fsync'd), the folder, manifest, renames, latest
    for step in range(1, per_save + 1):
        folder = tmp_path / f"kill{step}"
        # the first child dies in its second save (iteration 4), the second in the first save it makes
        # (a save after a resume may make fewer calls: nothing is left to remove)
        assert _killed_child(corpus, folder, per_save + step, async_save)
        _killed_child(corpus, folder, step, async_save)
        latest = read_latest(str(folder))[0]  # never a folder that is not complete
        assert latest is None or (folder / f"iter_{latest:07d}" / MANIFEST_FILE).is_file(), f"killed at step {step}"
        finished = Trainer(
            tiny_config(corpus, train_iters=ITERS, save=str(folder), load=str(folder), save_interval=INTERVAL), SINGLE
        )
        finished.train()
        for expected, resumed in zip(reference.engine.module.parameters(), finished.engine.module.parameters()):
            assert torch.equal(expected, resumed), f"killed at step {step}: the resumed run differs"
        assert sorted(p.name for p in folder.iterdir()) == ["iter_0000002", "iter_0000004", "iter_0000006", LATEST_FILE]


def _saved_run(corpus: str, folder: Path) -> Path:
    Trainer(tiny_config(corpus, train_iters=4, save=str(folder), save_interval=INTERVAL), SINGLE).train()
    return folder


def _flip_bit(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset % len(data)] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "name",
    [
        "model_rank00000.safetensors",
        "optimizer_rank00000.safetensors",
        "rng_rank00000.safetensors",
        MANIFEST_FILE,
    ],
)
@pytest.mark.parametrize("where", [0.1, 0.5, 0.97])
def test_a_flipped_bit_in_any_file_is_refused_naming_it_and_the_older_checkpoint(corpus, tmp_path, name, where):
    folder = _saved_run(corpus, tmp_path / "ckpt")
    damaged = folder / "iter_0000004" / name
    _flip_bit(damaged, int(damaged.stat().st_size * where))
    with pytest.raises(CheckpointError) as refused:
        Trainer(tiny_config(corpus, train_iters=6, load=str(folder), save=str(folder)), SINGLE)
    message = str(refused.value)
    assert "checkpoint iteration 4 is damaged" in message and "load iteration 2 instead with --ckpt-step 2" in message
    assert str(damaged) in message
    resumed = Trainer(tiny_config(corpus, train_iters=6, load=str(folder), save=str(folder), ckpt_step=2), SINGLE)
    assert resumed.iteration == 2


@pytest.mark.parametrize("latest", [None, "garbage\n", "\x00\x00", "8\n"])
def test_a_missing_or_bad_latest_resumes_from_the_newest_intact_checkpoint(corpus, tmp_path, capsys, latest):
    folder = _saved_run(corpus, tmp_path / "ckpt")
    _flip_bit(folder / "iter_0000004" / "model_rank00000.safetensors", 1000)  # the newest is damaged too
    if latest is None:
        (folder / LATEST_FILE).unlink()
    else:
        (folder / LATEST_FILE).write_text(latest)
    capsys.readouterr()
    resumed = Trainer(tiny_config(corpus, train_iters=6, load=str(folder), save=str(folder)), SINGLE)
    assert resumed.iteration == 2
    assert "resuming from the newest intact checkpoint, iteration 2" in capsys.readouterr().out


def test_a_fresh_run_does_not_overwrite_checkpoints_unless_told(corpus, tmp_path):
    folder = _saved_run(corpus, tmp_path / "ckpt")
    with pytest.raises(
        CheckpointError,
        match="already holds checkpoints up to iteration 4 and this run starts from "
        "iteration 0.*--overwrite-checkpoints",
    ):
        Trainer(tiny_config(corpus, train_iters=3, save=str(folder)), SINGLE)
    Trainer(tiny_config(corpus, train_iters=3, save=str(folder), overwrite_checkpoints=True), SINGLE).train()
    assert read_latest(str(folder))[0] == 3


def test_a_checkpoint_beyond_train_iters_is_one_sentence(corpus, tmp_path):
    folder = _saved_run(corpus, tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="at iteration 4, beyond --train-iters 3"):
        Trainer(tiny_config(corpus, train_iters=3, load=str(folder), save=str(folder)), SINGLE)


def test_leftovers_of_interrupted_saves_are_cleaned_up_with_a_log_line(corpus, tmp_path, capsys):
    folder = _saved_run(corpus, tmp_path / "ckpt")
    (folder / "iter_0000004").rename(folder / "iter_0000004.old")  # killed between the two renames
    (folder / "iter_0000006.tmp").mkdir()
    capsys.readouterr()
    resumed = Trainer(tiny_config(corpus, train_iters=6, load=str(folder), save=str(folder)), SINGLE)
    out = capsys.readouterr().out
    assert resumed.iteration == 4 and "restored" in out and "iter_0000006.tmp, a save that was interrupted" in out
    assert sorted(p.name for p in folder.iterdir()) == ["iter_0000002", "iter_0000004", LATEST_FILE]


def _mount_tmpfs(mount_point: Path, size: str) -> None:
    mount_point.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount_point)], capture_output=True
    )
    if done.returncode:
        pytest.skip(f"a full disk is simulated with a small tmpfs, which needs root: {done.stderr.decode().strip()}")


@pytest.fixture
def small_disk(corpus, tmp_path):
    """mount(extra): a disk with room for one checkpoint of the tiny model and `extra` bytes more."""
    probe = tmp_path / "probe"
    Trainer(tiny_config(corpus, train_iters=INTERVAL, lr_warmup_iters=1, save=str(probe)), SINGLE).train()
    checkpoint_bytes = sum(f.stat().st_size for f in probe.rglob("*") if f.is_file())
    mount_point = tmp_path / "disk"

    def mount(extra: int) -> Path:
        _mount_tmpfs(mount_point, f"{(checkpoint_bytes + extra) // 4096 * 4096 + 8192}")
        return mount_point

    yield mount, checkpoint_bytes
    subprocess.run(["umount", str(mount_point)], check=False)


def test_a_full_disk_stops_before_writing_and_keeps_the_last_checkpoint(corpus, small_disk):
    mount, checkpoint_bytes = small_disk
    folder = mount(checkpoint_bytes) / "ckpt"  # the data of a second checkpoint fits, its estimate does not
    trainer = Trainer(tiny_config(corpus, train_iters=4, save=str(folder), save_interval=INTERVAL), SINGLE)
    with pytest.raises(
        CheckpointError,
        match=r"iter_0000004 needs about [\d,]+ bytes but its disk has [\d,]+ free; "
        "nothing was written",
    ):
        trainer.train()
    assert sorted(p.name for p in folder.iterdir()) == ["iter_0000002", LATEST_FILE]
    assert read_latest(str(folder))[0] == 2


@pytest.mark.parametrize("how", ["sync", "async", "fast writer"])
def test_a_disk_that_fills_during_the_save_leaves_no_partial_folder(corpus, small_disk, monkeypatch, tmp_path, how):
    mount, checkpoint_bytes = small_disk
    folder = mount(checkpoint_bytes // 2) / "ckpt"
    # the disk reports room when the save starts and fills while it writes (another writer, say)
    monkeypatch.setattr(save_module.shutil, "disk_usage", lambda path: SimpleNamespace(free=10**12))
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"checkpoint": {"writer": {"type": "fast", "io_buffer_size": 8192}}}))
    extra = {"async": {"async_save": True}, "fast writer": {"deepspeed": True, "deepspeed_config": str(ds)}}.get(
        how, {}
    )
    trainer = Trainer(tiny_config(corpus, train_iters=4, save=str(folder), save_interval=INTERVAL, **extra), SINGLE)
    with pytest.raises(
        CheckpointError,
        match=r"iter_0000004 failed on rank 0 \(.*No space left on device.*\); the "
        r"partial folder was removed .* it needs about [\d,]+ bytes",
    ):
        trainer.train()
    assert sorted(p.name for p in folder.iterdir()) == ["iter_0000002", LATEST_FILE]
    resumed = Trainer(tiny_config(corpus, train_iters=4, load=str(folder)), SINGLE)
    assert resumed.iteration == 2


def test_a_deleted_manifest_is_refused_naming_the_folder_and_the_older_checkpoint(corpus, tmp_path):
    folder = _saved_run(corpus, tmp_path / "ckpt")
    (folder / "iter_0000004" / MANIFEST_FILE).unlink()
    with pytest.raises(CheckpointError) as refused:
        Trainer(tiny_config(corpus, train_iters=6, load=str(folder), save=str(folder)), SINGLE)
    assert str(refused.value) == (
        f"checkpoint iteration 4 is damaged: {folder / 'iter_0000004'} has no manifest.json although the version "
        "that saved it writes one, so its files cannot be verified; put back its manifest.json from a copy of the "
        "folder; load iteration 2 instead with --ckpt-step 2"
    )
    (folder / LATEST_FILE).unlink()  # the newest folder that verifies is iteration 2
    assert Trainer(tiny_config(corpus, train_iters=6, load=str(folder), save=str(folder)), SINGLE).iteration == 2


def test_checkpoints_without_a_manifest_still_load_and_damage_is_one_sentence(corpus, tmp_path, capsys):
    folder = format1_checkpoint(tmp_path / "ckpt")
    as_saved_before_manifests(folder / "iter_0000002")
    capsys.readouterr()

    def resume() -> Trainer:
        return Trainer(tiny_config(corpus, train_iters=4, load=str(folder), save=str(folder), **FORMAT1_FLAGS), SINGLE)

    assert resume().iteration == 2 and "has no manifest.json (saved by an earlier version)" in capsys.readouterr().out
    engine_json = folder / "iter_0000002" / "engine.json"
    text = engine_json.read_text()
    for damage, expected in (
        (text[:40], "engine.json is damaged"),
        (text.replace('"loss_scaler"', '"x"'), "engine.json lacks 'loss_scaler'"),
    ):
        engine_json.write_text(damage)
        with pytest.raises(CheckpointError, match=expected):
            resume()
    engine_json.write_text(text)
    model = folder / "iter_0000002" / "model_rank00000.safetensors"
    model.write_bytes(model.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="model_rank00000.safetensors is damaged"):
        resume()


def test_large_state_is_cut_into_parts_that_resume_exactly(corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(save_module, "PART_BYTES", 20_000)  # the tiny model's state is about 360 kB
    full = Trainer(tiny_config(corpus, train_iters=4, save=str(tmp_path / "full"), save_interval=2), SINGLE)
    full.train()
    folder = tmp_path / "full" / "iter_0000002"
    parts = [p.name for p in folder.iterdir() if p.name.startswith("optimizer_rank00000")]
    assert len(parts) > 3 and "optimizer_rank00000-1.safetensors" in parts
    (tmp_path / "full" / LATEST_FILE).write_text("2\n")
    resumed = Trainer(
        tiny_config(corpus, train_iters=4, load=str(tmp_path / "full"), save=str(tmp_path / "full")), SINGLE
    )
    resumed.train()
    for a, b in zip(full.engine.module.parameters(), resumed.engine.module.parameters()):
        assert torch.equal(a, b)
