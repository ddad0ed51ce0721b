"""`pretrain_gpt.py` / `megatron-pretrain-gpt`: parse flags, build the rank grid, train."""

from megatron.arguments import parse_args, with_data_parallel_size
from megatron.entry_point import run_entry_point
from megatron.parallel import build_parallel_grid
from megatron.training import TrainResult, pretrain


def _pretrain(argv: list[str] | None) -> TrainResult:
    config = parse_args(argv)
    grid = build_parallel_grid(ep_size=config.training.expert_parallel_size)
    return pretrain(with_data_parallel_size(config, grid.dp_size), grid)


def main(argv: list[str] | None = None) -> TrainResult:
    return run_entry_point(lambda: _pretrain(argv))
