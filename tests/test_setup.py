"""The Makefile's set-up on a fresh machine, read through `make -n` (prints the commands, runs none):
a virtual environment unless one is active, and the torch build chosen by whether nvidia-smi exists."""

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MAKE = shutil.which("make")
CPU_INDEX = "https://download.pytorch.org/whl/cpu"

pytestmark = pytest.mark.skipif(MAKE is None, reason="make is not installed")


def dry_run(target: str, *args: str, path: str, **env: str) -> str:
    """`make -n -B TARGET` with a clean environment: only PATH (for nvidia-smi) and the given variables.
    -B prints every step, the virtual environment's creation too, whether or not .venv exists here."""
    clean = {"PATH": path, "HOME": os.environ.get("HOME", "/tmp"), **env}
    result = subprocess.run(
        [MAKE, "-n", "-B", "--no-print-directory", target, *args],
        cwd=REPO,
        env=clean,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.fixture
def no_gpu_path(tmp_path: Path) -> str:
    empty = tmp_path / "bin-without-nvidia-smi"
    empty.mkdir()
    return str(empty)


@pytest.fixture
def gpu_path(tmp_path: Path) -> str:
    fake = tmp_path / "bin-with-nvidia-smi"
    fake.mkdir()
    smi = fake / "nvidia-smi"
    smi.write_text("#!/bin/sh\nexit 0\n")
    smi.chmod(smi.stat().st_mode | stat.S_IXUSR)
    return str(fake)


def test_without_an_active_environment_make_creates_and_uses_dot_venv(no_gpu_path: str) -> None:
    out = dry_run("test", path=no_gpu_path)
    assert "python3 -m venv .venv" in out
    assert '.venv/bin/python -m pip install -e ".[test]"' in out
    assert ".venv/bin/python -m pytest -q tests" in out


def test_an_active_virtual_environment_is_used_as_it_is(no_gpu_path: str, tmp_path: Path) -> None:
    env = str(tmp_path / "active-env")
    out = dry_run("test", path=no_gpu_path, VIRTUAL_ENV=env)
    assert "-m venv" not in out
    assert ".venv/" not in out
    assert f"{env}/bin/python -m pytest -q tests" in out


def test_python_on_the_command_line_wins(no_gpu_path: str) -> None:
    out = dry_run("install", "PYTHON=/opt/some/python", path=no_gpu_path)
    assert "-m venv" not in out
    assert "/opt/some/python -m pip install -e" in out


def test_python_in_the_environment_does_not_bypass_the_venv(no_gpu_path: str) -> None:
    out = dry_run("install", path=no_gpu_path, PYTHON="python3")
    assert "python3 -m venv .venv" in out
    assert ".venv/bin/python -m pip install -e" in out


def test_the_demo_runs_with_the_venv_python(no_gpu_path: str) -> None:
    out = dry_run("demo", path=no_gpu_path)
    assert "PYTHON=.venv/bin/python bash examples_deepspeed/pretrain_gpt_demo.sh" in out


def test_no_nvidia_smi_means_the_cpu_build_with_a_fallback(no_gpu_path: str) -> None:
    out = dry_run("install", path=no_gpu_path)
    torch_line = next(line for line in out.splitlines() if "torch==" in line)
    assert torch_line.startswith('.venv/bin/python -c "import torch"')  # only when torch is missing
    assert f"--index-url {CPU_INDEX} torch==2.13.0" in torch_line
    assert "--no-deps --timeout 10 --retries 1" in torch_line  # one page, short timeouts
    # torch's dependencies, or torch itself where that index did not answer, from pip's default index
    assert torch_line.rstrip("; }").endswith(".venv/bin/python -m pip install torch==2.13.0")


def test_nvidia_smi_on_path_means_the_default_cuda_build(gpu_path: str) -> None:
    out = dry_run("install", path=gpu_path)
    assert "download.pytorch.org" not in out
    torch_line = next(line for line in out.splitlines() if "torch==" in line)
    assert torch_line.startswith('.venv/bin/python -c "import torch"')
    assert torch_line.endswith("; .venv/bin/python -m pip install torch==2.13.0; }")
    assert "--index-url" not in torch_line


def test_the_build_can_be_chosen_by_hand(gpu_path: str, no_gpu_path: str) -> None:
    assert f"--index-url {CPU_INDEX}" in dry_run("install", "TORCH_VARIANT=cpu", path=gpu_path)
    assert "download.pytorch.org" not in dry_run("install", "TORCH_VARIANT=cuda", path=no_gpu_path)
    mirror = "https://mirror.example/torch-cpu"
    assert f"--index-url {mirror} torch==2.13.0" in dry_run("install", f"TORCH_INDEX_URL={mirror}", path=no_gpu_path)


def test_an_unknown_torch_variant_stops_with_the_choices(no_gpu_path: str) -> None:
    result = subprocess.run(
        [MAKE, "-n", "install", "TORCH_VARIANT=rocm"],
        cwd=REPO,
        env={"PATH": no_gpu_path},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert "TORCH_VARIANT=rocm is not one of cpu, cuda" in result.stderr


def test_dot_venv_is_git_ignored() -> None:
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    result = subprocess.run(["git", "check-ignore", "-q", ".venv/bin/python"], cwd=REPO, timeout=60)
    assert result.returncode == 0
