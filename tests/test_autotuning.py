"""The autotuner (tools/autotune.py --autotuning tune|run, the ds_config `autotuning` block): the
memory estimate prunes what cannot fit, fast mode keeps the memory savers for what needs them,
the search stops early, a small grid's best is the one an exhaustive run of the same grid
confirms, and a trial that runs out of memory (an address-space limit) is one row of the table."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.autotuning.space import GB, Setting, candidates, run_shape
from megatron.autotuning.trial import TrialResult
from megatron.autotuning.tuner import search
from megatron.config.flags import parse_args
from megatron.errors import ConfigError
from megatron.runtime.config.schema import AutotuningConfig, load_runtime_config
from tests.training_fixtures import tiny_flags, write_corpus

REPO = Path(__file__).resolve().parent.parent


def _shape(**overrides):
    flags = tiny_flags("unused", global_batch_size=64, **overrides)
    return run_shape(parse_args(flags), world_size=1, precision="fp32")


def test_the_estimate_prunes_by_name_and_fast_mode_saves_memory_only_where_needed():
    shape = _shape(hidden_size=256, seq_length=256, num_attention_heads=4)
    slow = candidates(shape, AutotuningConfig(fast=False), [0], available_bytes=0.6 * GB, on_gpu=False)
    by_name = {c.setting.name: c for c in slow}
    assert (
        by_name["z0_mbs64_ep1"].pruned.startswith("estimated ")
        and "0.60 GB available" in by_name["z0_mbs64_ep1"].pruned
    )
    assert by_name["z0_mbs1_ep1"].pruned is None
    # checkpointing stores a layer's input, not its activations: less memory at every micro-batch
    assert by_name["z0_mbs64_ep1_ckpt"].estimated_bytes < by_name["z0_mbs64_ep1"].estimated_bytes
    fast = candidates(shape, AutotuningConfig(num_tuning_micro_batch_sizes=2), [0], 0.6 * GB, on_gpu=False)
    running = [c.setting for c in fast if c.pruned is None]
    plain_fit = {s.micro_batch_size for s in running if not s.checkpoint_activations}
    assert all(s.micro_batch_size not in plain_fit for s in running if s.checkpoint_activations)
    assert any(s.checkpoint_activations for s in running)  # a micro-batch that fits only with it
    assert len({s.micro_batch_size for s in running}) == 2  # the two largest that fit
    assert all(not s.offload_optimizer for s in running)  # on a CPU offload moves nothing off the device


def _result(setting: Setting, samples: float) -> TrialResult:
    return TrialResult(setting, 0.0, "ok", 1000 / samples, samples, 0.0)


def test_the_search_stops_after_the_trials_without_a_better_one_and_at_the_trial_count():
    shape = _shape()
    found = candidates(shape, AutotuningConfig(fast=False), [0, 1, 2, 3], 1e12, on_gpu=False)
    speeds = {c.setting: 100.0 - i for i, c in enumerate(found)}  # the first is the best
    ran = search(found, AutotuningConfig(tuner_early_stopping=3), lambda c: _result(c.setting, speeds[c.setting]))
    assert len(ran.results) == 4 and ran.stopped_early and ran.best.setting == found[0].setting
    capped = search(
        found, AutotuningConfig(tuner_num_trials=2, tuner_early_stopping=50), lambda c: _result(c.setting, 1)
    )
    assert len(capped.results) == 2 and not capped.stopped_early


def test_blocks_keys_and_tuners_not_built_are_refused_by_name():
    deepspeeds = {"enabled": True, "arg_mappings": {"train_micro_batch_size_per_gpu": "--micro-batch-size"}}
    assert load_runtime_config({"train_batch_size": 2, "autotuning": deepspeeds}, 1).autotuning.enabled
    for block, message in (
        ({"tuner_type": "model_based"}, "tuner_type model_based .* is not built here; use gridsearch or random"),
        ({"model_info": {"num_params": 1}}, "unknown key 'autotuning.model_info'"),
        ({"start_profile_step": 5, "end_profile_step": 5}, "end_profile_step 5 is not after start_profile_step 5"),
    ):
        with pytest.raises(ConfigError, match=message):
            load_runtime_config({"train_batch_size": 2, "autotuning": {"enabled": True, **block}}, 1)


def _autotune(tmp_path: Path, flags: list[str], block: dict, stage, *own: str) -> subprocess.CompletedProcess:
    ds = tmp_path / "ds.json"
    block = {"enabled": True, "results_dir": str(tmp_path / "results"), "exps_dir": str(tmp_path / "exps"), **block}
    ds.write_text(json.dumps({"zero_optimization": {"stage": stage}, "autotuning": block}))
    command = [
        sys.executable,
        "tools/autotune.py",
        *own,
        "pretrain_gpt.py",
        *flags,
        "--deepspeed",
        "--deepspeed_config",
        str(ds),
    ]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, env={"OMP_NUM_THREADS": "1", "PATH": ""})


def _ms_per_iteration(log: str, after: int) -> float:
    times = [
        float(ms)
        for it, ms in re.findall(r"iteration\s+(\d+)/.*?per iteration \(ms\): ([0-9.]+)", log)
        if int(it) > after
    ]
    return sum(times) / len(times)


def test_run_picks_the_best_of_a_grid_that_an_exhaustive_run_confirms_and_trains_with_it(tmp_path):
    corpus = write_corpus(tmp_path)
    flags = tiny_flags(corpus, global_batch_size=16, micro_batch_size=1, train_iters=6, num_experts=4, eval_iters=1)
    block = {"fast": False, "start_profile_step": 2, "end_profile_step": 5, "min_train_micro_batch_size_per_gpu": 4}
    done = _autotune(tmp_path, flags, {**block, "max_train_micro_batch_size_per_gpu": 16}, [0], "--autotuning", "run")
    assert done.returncode == 0, done.stderr[-2000:]
    table = (tmp_path / "results" / "summary.txt").read_text()
    assert len(re.findall(r"^\s+\d+\s+z0_mbs", table, re.M)) == 6  # 4, 8, 16, each with and without checkpointing
    best = json.loads((tmp_path / "results" / "ds_config_optimal.json").read_text())
    command = (tmp_path / "results" / "cmd_optimal.txt").read_text().split()
    best_mbs = int(command[command.index("--micro-batch-size") + 1])
    assert best["zero_optimization"]["stage"] == 0
    # the exhaustive run: every trial's command again, twice, timed from its own log here
    exhaustive = {}
    for folder in sorted((tmp_path / "exps").iterdir()):
        trial = (folder / "cmd.txt").read_text().split()
        runs = [subprocess.run(trial, cwd=REPO, capture_output=True, text=True).stdout for _ in range(2)]
        exhaustive[folder.name] = min(_ms_per_iteration(log, 2) for log in runs)
    fastest = min(exhaustive, key=exhaustive.get)
    chosen = f"z0_mbs{best_mbs}_ep1" + ("_ckpt" if "--checkpoint-activations" in command else "")
    assert f"_mbs{best_mbs}_" in fastest + "_"  # the micro-batch the exhaustive run finds fastest
    assert exhaustive[chosen] <= 1.15 * exhaustive[fastest]
    # `run` trained with the best setting: its own log follows the table
    assert "> running: " in done.stdout and "iteration        6/       6" in done.stdout


def test_a_trial_that_runs_out_of_memory_is_one_row_and_the_search_goes_on(tmp_path):
    corpus = write_corpus(tmp_path)
    flags = tiny_flags(
        corpus, global_batch_size=256, micro_batch_size=1, train_iters=50, hidden_size=256, seq_length=128, eval_iters=1
    )
    block = {"fast": False, "start_profile_step": 1, "end_profile_step": 2, "min_train_micro_batch_size_per_gpu": 128}
    done = _autotune(tmp_path, flags, block, 0, "--autotuning", "tune", "--trial-memory-limit-gb", "2.0")
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {line.split()[1]: line for line in done.stdout.splitlines() if re.match(r"^\s+(\d+|-)\s+z0_", line)}
    assert rows["z0_mbs256_ep1"].rstrip().endswith("out of memory")  # 2.8 GB at its peak, unlimited
    assert rows["z0_mbs128_ep1_ckpt"].split()[0] != "-"  # a setting that fits ran and is ranked
    assert "can't allocate memory" in (tmp_path / "exps" / "z0_mbs256_ep1" / "stderr.log").read_text()
