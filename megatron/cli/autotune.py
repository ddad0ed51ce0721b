"""`tools/autotune.py --autotuning tune|run [--nproc-per-node N] pretrain_gpt.py FLAGS...`: DeepSpeed's
autotuner for a Megatron command line. The ds_config named by the command's --deepspeed_config
holds the `autotuning` block (DeepSpeed's keys); `zero_optimization.stage` may be a list of the
stages to try, as in DeepSpeed's autotuning configs (absent: 0-3). `tune` searches, prints the
ranked table and writes it with the best ds_config and command to `results_dir`; `run` then
starts that command."""

import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from megatron.autotuning.space import GB, Candidate, candidates, run_shape
from megatron.autotuning.trial import (
    TrialResult,
    launcher,
    run_trial,
    setting_flags,
    trial_ds_config,
    trial_flags,
    without,
)
from megatron.autotuning.tuner import ranked_table, search, write_results
from megatron.config.flags import parse_args
from megatron.config.parser import FlagParser, positive_float, positive_int
from megatron.entry_point import run_entry_point
from megatron.errors import ConfigError
from megatron.runtime.config.config_file import read_config_source
from megatron.runtime.config.schema import AutotuningConfig, load_runtime_config


def build_autotune_parser() -> FlagParser:
    parser = FlagParser(
        prog="tools/autotune.py",
        description="Search ZeRO stage, micro-batch size, activation checkpointing, optimizer offload and the "
        "expert-parallel size for a pretrain_gpt.py command line, each trial in its own process.",
    )
    parser.add_argument("--autotuning", choices=["tune", "run"], required=True, help="tune: search; run: also train")
    parser.add_argument("--nproc-per-node", type=positive_int, default=1, help="ranks per trial (torchrun)")
    parser.add_argument(
        "--trial-memory-limit-gb",
        type=positive_float,
        default=None,
        help="address-space limit of each trial process; also the memory the estimator prunes against",
    )
    parser.add_argument("--trial-timeout", type=positive_float, default=1800.0, help="seconds before a trial stops")
    parser.add_argument("script", help="the training script (pretrain_gpt.py), then its flags with --deepspeed_config")
    return parser


def split_command(argv: list[str]) -> tuple[list[str], list[str]]:
    """The autotuner's own flags with the script, and the script's flags after it."""
    script = next((i for i, arg in enumerate(argv) if arg.endswith(".py") and not arg.startswith("-")), None)
    if script is None:
        raise ConfigError(
            "name the training script after the autotuner's flags: tools/autotune.py ... pretrain_gpt.py FLAGS"
        )
    return argv[: script + 1], argv[script + 1 :]


def _config_path(flags: list[str]) -> str | None:
    return flags[flags.index("--deepspeed_config") + 1] if "--deepspeed_config" in flags[:-1] else None


def _base_config(flags: list[str]) -> tuple[dict[str, Any], list[int], AutotuningConfig]:
    """The command's ds_config (stages listed taken out), the stages to try, its autotuning block."""
    path = _config_path(flags)
    base, source = read_config_source(path) if path else ({}, "no ds_config")
    zero = dict(base.get("zero_optimization", {}))
    stage = zero.pop("stage", [0, 1, 2, 3])
    stages = stage if isinstance(stage, list) else [stage]
    if not stages or any(s not in (0, 1, 2, 3) for s in stages):
        raise ConfigError(f"zero_optimization.stage in {source} lists {stages}; list stages from 0, 1, 2 and 3")
    base = {**base, "zero_optimization": zero}
    tuning = load_runtime_config({"train_batch_size": 1, "autotuning": base.get("autotuning", {})}, 1).autotuning
    return base, stages, tuning


def _available_bytes(nproc: int, limit_gb: float | None) -> float:
    if torch.cuda.is_available():
        available = float(torch.cuda.get_device_properties(0).total_memory)
    else:  # the ranks of a node share its memory
        meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        available = int(meminfo["MemAvailable"].split()[0]) * 1024 / nproc
    return min(available, limit_gb * GB) if limit_gb else available


def _precision(flags: list[str], base: dict[str, Any]) -> str:
    for name in ("fp16", "bf16"):
        if f"--{name}" in flags or base.get(name, {}).get("enabled") is True:
            return name
    return "fp32"


def autotune(argv: list[str] | None) -> int:
    own, flags = split_command(sys.argv[1:] if argv is None else argv)
    args = build_autotune_parser().parse_args(own)
    base, stages, tuning = _base_config(flags)
    config = parse_args(without(flags, {"--deepspeed": False, "--deepspeed_config": True}))
    t = config.training
    if t.default_global_batch:
        raise ConfigError("give --global-batch-size: the autotuner keeps the global batch and varies the micro-batch")
    if tuning.mp_size not in (1, t.tensor_parallel_size * t.pipeline_parallel_size):
        raise ConfigError(
            f"autotuning.mp_size {tuning.mp_size} is not the flags' tensor x pipeline parallel size "
            f"{t.tensor_parallel_size * t.pipeline_parallel_size}; remove it or make them agree"
        )
    if t.train_iters is None:
        raise ConfigError("give --train-iters: the trials run the first iterations of that schedule")
    shape = run_shape(config, args.nproc_per_node, _precision(flags, base))
    available = _available_bytes(args.nproc_per_node, args.trial_memory_limit_gb)
    found = candidates(shape, tuning, stages, available, torch.cuda.is_available())
    exps, results = Path(tuning.exps_dir), Path(tuning.results_dir)
    limit = int(args.trial_memory_limit_gb * GB) if args.trial_memory_limit_gb else None
    runnable = sum(c.pruned is None for c in found)
    print(
        f" > autotuning: {len(found)} settings, {len(found) - runnable} pruned by the memory estimate "
        f"({available / GB:.2f} GB a rank), up to {min(runnable, tuning.tuner_num_trials)} trials of "
        f"{tuning.end_profile_step} iterations ({tuning.tuner_type}, metric {tuning.metric})",
        flush=True,
    )
    bar = tqdm(total=min(runnable, tuning.tuner_num_trials), desc="autotuning trials", unit="trial")

    def run(candidate: Candidate) -> TrialResult:
        folder = exps / candidate.setting.name
        result = run_trial(
            args.script,
            trial_flags(flags, candidate.setting, folder / "ds_config.json", tuning, t.train_iters),
            trial_ds_config(base, candidate.setting),
            candidate.setting,
            candidate.estimated_bytes,
            folder,
            tuning,
            args.nproc_per_node,
            limit,
            args.trial_timeout,
        )
        bar.update()
        bar.write(f" > trial {candidate.setting.name}: {result.status}" + _measured(result))
        return result

    outcome = search(found, tuning, run)
    bar.close()
    if outcome.stopped_early:
        print(f" > stopped early: {tuning.tuner_early_stopping} trials in a row without a better {tuning.metric}")
    print(ranked_table(outcome, tuning.metric), flush=True)
    if outcome.best is None:
        write_results(results, outcome, tuning.metric, None, None)
        raise ConfigError(f"no trial ran to its end_profile_step; see {exps}/*/stderr.log and the table above")
    best_config_path = results / "ds_config_optimal.json"
    command = [
        *launcher(args.nproc_per_node),
        args.script,
        *setting_flags(flags, outcome.best.setting, best_config_path),
    ]
    best_config = trial_ds_config(base, outcome.best.setting)
    best_config["autotuning"] = base.get("autotuning", {})
    write_results(results, outcome, tuning.metric, best_config, shlex.join(command))
    print(
        f" > best: {outcome.best.setting.name}; wrote {results}/summary.txt, {best_config_path.name}, cmd_optimal.txt"
    )
    if args.autotuning == "tune":
        return 0
    print(f" > running: {shlex.join(command)}", flush=True)
    return subprocess.run(command, env=dict(os.environ)).returncode


def _measured(result: TrialResult) -> str:
    if result.status != "ok":
        return ""
    return f" ({result.ms_per_iteration:.1f} ms/iteration, {result.samples_per_second:.2f} samples/s)"


def main(argv: list[str] | None = None) -> None:
    sys.exit(run_entry_point(lambda: autotune(argv)))
