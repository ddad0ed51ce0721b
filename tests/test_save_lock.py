"""One writer per --save folder, with real runs: a second live run (one process, and two ranks) is
refused with one sentence naming the first run's host and pid, before it touches the folder; the
lock a SIGKILLed run left is taken over with a log line; a run that ends, or stops on an error,
removes it."""

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron.checkpoint.iterations import read_latest
from megatron.checkpoint.save_lock import LOCK_FILE
from megatron.errors import CheckpointError
from megatron.parallel import single_process_grid
from megatron.training.loop import pretrain
from tests.training_fixtures import tiny_config, tiny_flags, write_corpus

REPO = Path(__file__).resolve().parent.parent
PRETRAIN = str(REPO / "pretrain_gpt.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def _first_run(corpus: str, save: Path) -> subprocess.Popen:
    """A long run saving into `save`, once it has trained 3 iterations and saved iteration 2."""
    flags = tiny_flags(
        corpus,
        train_iters=100000,
        log_interval=1,
        eval_interval=100000,
        save=str(save),
        save_interval=2,
        exit_signal_handler=True,
    )
    run = subprocess.Popen(
        [sys.executable, PRETRAIN, *flags],
        cwd=REPO,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines = []
    for line in run.stdout:
        lines.append(line)
        if "iteration        3/" in line:
            return run
    raise AssertionError(f"the first run ended early:\n{''.join(lines)}")


def _second_run(corpus: str, save: Path, world: int = 1, **overrides) -> list[subprocess.CompletedProcess]:
    """The same recipe started again on `save` (--save X --load X), as `world` ranks."""
    flags = tiny_flags(corpus, save=str(save), load=str(save), **overrides)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ranks = []
    for rank in range(world):
        env = dict(ENV)
        if world > 1:
            env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        ranks.append(
            subprocess.Popen(
                [sys.executable, PRETRAIN, *flags], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
            )
        )
    outputs = [rank.communicate(timeout=120) for rank in ranks]
    return [
        subprocess.CompletedProcess(rank.args, rank.returncode, out.decode(), err.decode())
        for rank, (out, err) in zip(ranks, outputs)
    ]


@pytest.mark.parametrize("world", [1, 2])
def test_a_second_live_run_on_the_same_save_is_refused_naming_host_and_pid(corpus, tmp_path, world):
    save = tmp_path / "ckpt"
    first = _first_run(corpus, save)
    try:
        staged = save / "iter_0000099.tmp"  # as the first run's save in progress would leave it
        staged.mkdir()
        second = _second_run(corpus, save, world)
        assert [rank.returncode for rank in second] == [1] * world, second
        (line,) = second[0].stderr.splitlines()
        assert line == (
            f"error: --save {save} is in use by another training run (host {socket.gethostname()}, pid {first.pid}, "
            f"which holds {save / LOCK_FILE}); wait for that run to end or choose another --save folder"
        )
        assert all(rank.stderr == "" for rank in second[1:])  # the other ranks stop too, quietly
        assert staged.is_dir()  # refused before it repaired the folder it would have shared
        staged.rmdir()
        first.send_signal(signal.SIGTERM)
        output = first.communicate(timeout=120)[0]
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    assert first.returncode == 0, output
    assert not (save / LOCK_FILE).exists()  # the run ended: its lock went with it
    iteration = read_latest(str(save))[0]
    assert f"exiting at iteration {iteration} of 100000: received SIGTERM" in output


def test_the_lock_of_a_killed_run_is_taken_over_with_a_log_line(corpus, tmp_path):
    save = tmp_path / "ckpt"
    first = _first_run(corpus, save)
    first.kill()  # SIGKILL: no cleanup runs, the lock file stays behind naming it
    first.communicate(timeout=60)
    assert (save / LOCK_FILE).exists()
    (second,) = _second_run(corpus, save, train_iters=8)
    assert second.returncode == 0, second.stdout + second.stderr
    assert (
        f" > took over the lock {save / LOCK_FILE} left by pid {first.pid} on host {socket.gethostname()}, "
        "which ended without releasing it"
    ) in second.stdout
    assert read_latest(str(save))[0] == 8 and not (save / LOCK_FILE).exists()


def test_a_run_that_stops_on_an_error_removes_its_lock(corpus, tmp_path):
    save = tmp_path / "ckpt"
    grid = single_process_grid(torch.device("cpu"))
    pretrain(tiny_config(corpus, train_iters=2, lr_warmup_iters=1, save=str(save)), grid)
    assert not (save / LOCK_FILE).exists()
    with pytest.raises(CheckpointError, match="already holds checkpoints up to iteration 2"):
        pretrain(tiny_config(corpus, train_iters=2, lr_warmup_iters=1, save=str(save)), grid)  # no --load
    assert sorted(p.name for p in save.iterdir()) == ["iter_0000002", "latest_checkpointed_iteration.txt"]


def test_a_save_folder_that_cannot_be_made_is_one_sentence_at_start_up(corpus, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    config = tiny_config(corpus, train_iters=2, lr_warmup_iters=1, save=str(blocker / "ckpt"))
    with pytest.raises(CheckpointError, match=r"cannot write into --save .*a_file/ckpt \(.*\); choose a folder"):
        pretrain(config, single_process_grid(torch.device("cpu")))
