"""The MFU's denominator: a stated peak is used as given; otherwise a GEMM probe measures this
machine once and later runs read the cached value; the training log shows MFU against it; and
docs/profiling.md's example runs as pasted."""

import json
import re
from pathlib import Path

import pytest
import torch

from megatron.parallel import single_process_grid
from megatron.profiling import peak_flops as peak_module
from megatron.profiling.peak_flops import cache_file, peak_flops, probe_tflops
from megatron.training.loop import Trainer
from tests.training_fixtures import tiny_config, write_corpus

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def test_a_stated_peak_is_used_as_given():
    assert peak_flops(CPU, torch.float32, 12.5) == peak_module.PeakFlops(12.5, "stated by --peak-tflops")


def test_the_probe_measures_once_and_later_runs_read_the_cache():
    first = peak_flops(CPU, torch.float32, None)
    assert first.source == "a GEMM probe of this machine at start-up" and first.tflops > 0
    saved = json.loads(cache_file().read_text())
    assert list(saved.values()) == [first.tflops] and f"{torch.get_num_threads()} threads" in next(iter(saved))
    again = peak_flops(CPU, torch.float32, None)
    assert again.tflops == first.tflops and again.source.startswith("a GEMM probe of this machine, cached in")


def test_a_damaged_cache_is_measured_again_and_rewritten():
    cache_file().parent.mkdir(parents=True)
    cache_file().write_text("{not json")
    measured = peak_flops(CPU, torch.float32, None)
    assert measured.source == "a GEMM probe of this machine at start-up"
    assert json.loads(cache_file().read_text()) == {peak_module._machine_key(CPU, torch.float32): measured.tflops}


def test_the_probe_is_a_gemm_rate_of_this_machine():
    # 2 cores of a 2020s CPU: between 1 GFLOP/s and 10 TFLOP/s in fp32, whatever the vector unit
    assert 1e-3 < probe_tflops(CPU, torch.float32) < 10


def test_every_log_line_shows_mfu_against_the_stated_peak(tmp_path, capsys):
    config = tiny_config(write_corpus(tmp_path), train_iters=4, log_interval=2, peak_tflops=0.001)
    Trainer(config, single_process_grid(CPU)).train()
    out = capsys.readouterr().out
    assert " > MFU in the log is against 0.001 TFLOP/s per rank, from stated by --peak-tflops" in out
    lines = re.findall(r"TFLOP/s: ([\d.]+) \| MFU: ([\d.]+)% \|", out)
    assert len(lines) == 2
    for tflops, mfu in lines:  # TFLOP/s is printed to 0.001, MFU to 0.1% of 0.001
        assert abs(float(mfu) / 100 * 0.001 - float(tflops)) <= 0.0006, (tflops, mfu)


def test_the_profiling_page_example_runs_as_pasted(capsys):
    page = (Path(__file__).resolve().parents[1] / "docs" / "profiling.md").read_text()
    example = re.search(r"```python\n(.*?)```", page, re.S).group(1)
    exec(compile(example, "docs/profiling.md", "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    assert re.fullmatch(r"[\d.]+ [KMG] [\d.]+ [KMG]MACs [\d.]+ K", printed[0])
    assert re.fullmatch(r"[\d.]+ [KMG] [\d.]+ m?s", printed[1])
