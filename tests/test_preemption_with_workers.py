"""Preemption as a scheduler does it, with DataLoader workers (--num-workers 2, the default): a real
SIGTERM to the run's whole process group (Slurm, Kubernetes) and to torchrun (which forwards it to
each rank's group) ends in the exit save and status 0, not in "DataLoader worker ... killed by
signal"; the workers still end with the trainer (SIGTERM without the handler, SIGKILL); and an
error raised inside a worker reaches the user as the worker's own one sentence."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron.checkpoint.iterations import read_latest
from tests.training_fixtures import VOCAB, tiny_flags, wait_for_line, write_corpus

REPO = Path(__file__).resolve().parent.parent
PRETRAIN = str(REPO / "pretrain_gpt.py")
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
# a rank under torchrun that says how it ended: torchrun itself always ends a SIGTERM with its own
# SignalException traceback and status 1, whatever its ranks did
RANK_SAYING_ITS_STATUS = """
import runpy, sys
sys.argv = sys.argv[1:]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
    status = 0
except SystemExit as stop:
    status = stop.code or 0
print(f"rank exit status {status}", flush=True)
sys.exit(status)
"""


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def _start(command: list[str]) -> subprocess.Popen:
    """`command` in a process group of its own, as a scheduler starts a job step."""
    return subprocess.Popen(
        command,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _flags(corpus: str, save: Path, **overrides: object) -> list[str]:
    return tiny_flags(
        corpus, train_iters=100000, log_interval=1, eval_interval=100000, save=str(save), num_workers=2, **overrides
    )


def _children(pid: int) -> list[int]:
    return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def _signal_at_iteration_3(process: subprocess.Popen, send) -> str:
    seen = wait_for_line(process, "iteration        3/")
    send(process.pid)
    try:
        return "".join(seen) + process.communicate(timeout=120)[0]
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)


def _assert_saved_at_exit(output: str, save: Path) -> None:
    assert "killed by signal" not in output and "DataLoader worker" not in output, output
    iteration = read_latest(str(save))[0]
    assert iteration is not None and iteration >= 3, output
    assert f"exiting at iteration {iteration} of 100000: received SIGTERM (--exit-signal-handler)" in output


def test_sigterm_to_the_process_group_saves_and_exits_zero(corpus, tmp_path):
    save = tmp_path / "ckpt"
    process = _start([sys.executable, PRETRAIN, *_flags(corpus, save, exit_signal_handler=True)])
    output = _signal_at_iteration_3(process, lambda pid: os.killpg(pid, signal.SIGTERM))  # trainer and workers
    assert process.returncode == 0 and "Traceback" not in output, output
    _assert_saved_at_exit(output, save)


def test_sigterm_to_torchrun_saves_and_the_rank_exits_zero(corpus, tmp_path):
    save = tmp_path / "ckpt"
    launcher = [TORCHRUN, "--nproc-per-node", "1", "--master-port", "0", "--no-python", sys.executable]
    rank = ["-c", RANK_SAYING_ITS_STATUS, PRETRAIN, *_flags(corpus, save, exit_signal_handler=True)]
    process = _start(launcher + rank)
    output = _signal_at_iteration_3(process, lambda pid: os.kill(pid, signal.SIGTERM))  # torchrun alone
    assert "rank exit status 0" in output and "forcefully exiting" not in output, output
    _assert_saved_at_exit(output, save)


def test_without_the_handler_the_workers_end_with_the_trainer(corpus, tmp_path):
    process = _start([sys.executable, PRETRAIN, *_flags(corpus, tmp_path / "ckpt")])
    seen = wait_for_line(process, "iteration        3/")
    workers = _children(process.pid)
    assert len(workers) == 2, seen
    os.killpg(process.pid, signal.SIGTERM)
    output = "".join(seen) + process.communicate(timeout=60)[0]
    assert process.returncode == 128 + signal.SIGTERM and "killed by signal" not in output, output
    assert not any(_alive(worker) for worker in workers)


def test_the_workers_of_a_killed_trainer_end_within_seconds(corpus, tmp_path):
    process = _start([sys.executable, PRETRAIN, *_flags(corpus, tmp_path / "ckpt", exit_signal_handler=True)])
    wait_for_line(process, "iteration        3/")
    workers = _children(process.pid)
    assert len(workers) == 2
    process.kill()  # the trainer alone: its workers notice their parent is gone
    process.communicate(timeout=60)
    deadline = time.monotonic() + 30
    while any(_alive(worker) for worker in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(worker) for worker in workers)


def test_an_error_in_a_worker_is_printed_as_its_own_sentence(tmp_path):
    bad = write_corpus(tmp_path, vocab=2 * VOCAB)  # ids up to 120, against --vocab-size 61
    done = subprocess.run(
        [sys.executable, PRETRAIN, *tiny_flags(bad, train_iters=4, num_workers=2)],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    (line,) = done.stderr.splitlines()  # no traceback, no "Caught DataError in DataLoader worker process 0"
    assert line.startswith(f"error: {bad}: document ") and "outside the vocabulary of 61 ids" in line, line
    assert line.endswith("preprocess the data with the same tokenizer as training."), line
