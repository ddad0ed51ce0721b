"""Overhead of the observability features on a training step: the FLOPs profiler outside its
`profile_step`, the communication logger (`comms_logger`, every op synchronised and timed) and
Megatron's timers at `--timing-log-level 2`, each against the same run with all of them off.
Target: each at most 1.03x the time of the step without it.

Two gloo ranks, an MoE GPT with expert parallelism 2 and ZeRO stage 2 (so the step has the
experts' all-to-alls, the reduce-scatters and the parameter all-gathers that the logger and the
timers see), through Trainer.train_step with the run's recording contexts installed as
Trainer.train installs them; the timers are read (a world all-gather) every 10 iterations as at a
log line. The variants run interleaved in rounds, the order reversed every other round; each
ratio is the median of the per-round ratios of the slower rank's time.

Prints a table and writes JSON (default benchmarks/results/observability.json).
"""

import argparse
import io
import json
import statistics
import tempfile
import time
from contextlib import ExitStack, redirect_stdout
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.aio import machine
from megatron.config.flags import parse_args, with_data_parallel_size
from megatron.parallel import build_parallel_grid
from megatron.training.loop import Trainer
from tests.dist_utils import run_distributed
from tests.training_fixtures import tiny_flags, write_corpus

VARIANTS = ("off", "flops_profiler", "comms_logger", "timers_level_2")
TARGET = 1.03
LOG_INTERVAL = 10
SHAPE = dict(
    num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=128, micro_batch_size=4, global_batch_size=8
)


def build(variant: str, corpus: str, folder: str, iterations: int) -> Trainer:
    grid = build_parallel_grid(torch.device("cpu"), ep_size=2)
    block = {
        "zero_optimization": {"stage": 2},
        "flops_profiler": {"enabled": variant == "flops_profiler", "profile_step": 1, "output_file": f"{folder}/p"},
        "comms_logger": {"enabled": variant == "comms_logger"},
    }
    ds_config = f"{folder}/ds_{variant}.json"
    if grid.rank == 0:
        Path(ds_config).write_text(json.dumps(block))
    grid.barrier()
    flags = tiny_flags(
        corpus,
        **SHAPE,
        num_experts=8,
        topk=2,
        moe_expert_parallel_size=2,
        train_iters=iterations,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        timing_log_level=2 if variant == "timers_level_2" else 0,
    )
    config = parse_args(flags + ["--deepspeed", "--deepspeed_config", ds_config])
    with redirect_stdout(io.StringIO()):
        return Trainer(with_data_parallel_size(config, grid.dp_size), grid)


def rank_run(corpus: str, folder: str, warmup: int, steps: int, rounds: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    iterations = warmup + steps * rounds
    trainers = {variant: build(variant, corpus, folder, iterations) for variant in VARIANTS}
    data = {variant: trainer.loader(trainer.train_data, 0) for variant, trainer in trainers.items()}
    seconds = {variant: [] for variant in VARIANTS}

    def run(variant: str, count: int) -> float:
        trainer = trainers[variant]
        with ExitStack() as recording:
            recording.enter_context(trainer.engine.comms_recording())
            if trainer.timers is not None:
                recording.enter_context(trainer.timers.recording())
            dist.barrier()
            began = time.perf_counter()
            for index in range(count):
                trainer.train_step(data[variant])
                if trainer.timers is not None and (index + 1) % LOG_INTERVAL == 0:
                    trainer.timers.readings(LOG_INTERVAL)
            elapsed = time.perf_counter() - began
        slowest = torch.tensor(elapsed)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        return float(slowest)

    with redirect_stdout(io.StringIO()):  # the profile of step 1 (warm-up) goes to its file anyway
        for variant in VARIANTS:
            run(variant, warmup)
        for round_ in range(rounds):
            for variant in VARIANTS if round_ % 2 == 0 else reversed(VARIANTS):
                seconds[variant].append(run(variant, steps) / steps)
    return {variant: torch.tensor(values, dtype=torch.float64) for variant, values in seconds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--output", default="benchmarks/results/observability.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        corpus = write_corpus(Path(folder), documents=2000, length=300)
        per_round = run_distributed(rank_run, 2, corpus, folder, args.warmup, args.steps, args.rounds)[0]
        info = machine(Path(folder))
    off = per_round["off"].tolist()
    rows = []
    print(f"{'variant':<18}{'ms/step (median)':>18}{'x off (median of rounds)':>26}{'min-max':>16}{'target':>10}")
    for variant in VARIANTS:
        times = per_round[variant].tolist()
        ratios = [t / o for t, o in zip(times, off)]
        row = {
            "variant": variant,
            "ms_per_step": 1000 * statistics.median(times),
            "ratio_to_off": statistics.median(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
            "per_round_ms": [1000 * t for t in times],
        }
        rows.append(row)
        verdict = "" if variant == "off" else ("ok" if row["ratio_to_off"] <= TARGET else "OVER")
        print(
            f"{variant:<18}{row['ms_per_step']:>18.1f}{row['ratio_to_off']:>26.3f}"
            f"{row['ratio_min']:>8.3f}-{row['ratio_max']:<7.3f}{verdict:>10}"
        )
    result = {
        "machine": info,
        "date": time.strftime("%Y-%m-%d"),
        "shape": SHAPE,
        "args": vars(args),
        "target": TARGET,
        "rows": rows,
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
