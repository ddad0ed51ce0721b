"""`pretrain_gpt.py` / `megatron-pretrain-gpt`: choose the CPU threads, parse flags, build the rank
grid, train (or, with --dry-run, check the flags and print the model's size without building it)."""

import os
from typing import TYPE_CHECKING

from megatron.cli.threads import ThreadChoice, choose_threads

if TYPE_CHECKING:
    from megatron.training.loop import TrainResult


def pretrain_from_flags(argv: list[str] | None, threads: ThreadChoice) -> "TrainResult | None":
    """What main() runs once the threads are set; torch loads with these imports."""
    from megatron.config.flags import parse_args, with_data_parallel_size
    from megatron.model_size import dry_run
    from megatron.parallel import build_parallel_grid, launched_world_size
    from megatron.training.loop import pretrain

    config = parse_args(argv)
    if os.environ.get("RANK", "0") == "0":
        print(threads.describe(), flush=True)
    if config.dry_run:  # no process group: the world size is what torchrun would start
        t = config.training
        world = launched_world_size(
            t.expert_parallel_size,
            tp_size=t.tensor_parallel_size,
            pp_size=t.pipeline_parallel_size,
            expert_tp_size=t.expert_tensor_parallel_size,
        )
        return dry_run(
            with_data_parallel_size(config, world // (t.tensor_parallel_size * t.pipeline_parallel_size)), world
        )
    t = config.training
    grid = build_parallel_grid(
        ep_size=t.expert_parallel_size,
        tp_size=t.tensor_parallel_size,
        pp_size=t.pipeline_parallel_size,
        expert_tp_size=t.expert_tensor_parallel_size,
    )
    return pretrain(with_data_parallel_size(config, grid.dp_size), grid)


def main(argv: list[str] | None = None) -> None:
    """The console script's entry: its return value becomes the exit status, so it returns None."""
    threads = choose_threads(os.environ)  # before anything imports torch
    from megatron.entry_point import run_entry_point

    run_entry_point(lambda: pretrain_from_flags(argv, threads))
