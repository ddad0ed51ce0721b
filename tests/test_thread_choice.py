"""The training entry point's CPU threads: OMP_NUM_THREADS and OMP_WAIT_POLICY filled in before torch
loads (the environment wins), and the line that says what was chosen."""

import os
import subprocess
import sys
from pathlib import Path

from megatron.cli.threads import choose_threads, usable_cores
from tests.training_fixtures import tiny_flags

REPO = Path(__file__).resolve().parent.parent


def test_threads_are_the_cores_shared_among_the_node_s_processes() -> None:
    environ: dict[str, str] = {}
    choice = choose_threads(environ)
    assert environ == {"OMP_NUM_THREADS": str(usable_cores()), "OMP_WAIT_POLICY": "PASSIVE"}
    assert choice.chosen_here and "chosen for this machine" in choice.describe()
    environ = {"LOCAL_WORLD_SIZE": str(2 * usable_cores())}
    assert choose_threads(environ).threads == "1"  # never 0


def test_the_environment_wins() -> None:
    environ = {"OMP_NUM_THREADS": "3", "OMP_WAIT_POLICY": "ACTIVE", "LOCAL_WORLD_SIZE": "4"}
    choice = choose_threads(environ)
    assert environ["OMP_NUM_THREADS"] == "3" and environ["OMP_WAIT_POLICY"] == "ACTIVE"
    assert not choice.chosen_here and "set by the environment" in choice.describe()
    environ = {"OMP_NUM_THREADS": "3"}
    assert choose_threads(environ).wait_policy == "PASSIVE" and environ["OMP_NUM_THREADS"] == "3"


def clean_environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "LOCAL_WORLD_SIZE")}


def test_torch_loads_with_the_chosen_threads() -> None:
    # two processes per node on two cores: torch alone would take both cores in each process
    code = (
        "import os; from megatron.cli.threads import choose_threads; choose_threads(os.environ); "
        "import torch; print(torch.get_num_threads(), os.environ['OMP_WAIT_POLICY'])"
    )
    done = subprocess.run(
        ["taskset", "-c", "0,1", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={**clean_environment(), "LOCAL_WORLD_SIZE": "2"},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1", "PASSIVE"]


def test_pretrain_gpt_says_what_it_chose(tmp_path: Path) -> None:
    flags = [*tiny_flags(str(tmp_path / "unused")), "--dry-run"]
    done = subprocess.run(
        [sys.executable, "pretrain_gpt.py", *flags],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env=clean_environment(),
    )
    assert done.returncode == 0, done.stderr
    first = done.stdout.splitlines()[0]
    assert (
        first.startswith(" > CPU threads per process: ") and "OMP_WAIT_POLICY=PASSIVE (chosen for this machine" in first
    )
