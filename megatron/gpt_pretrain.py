"""`pretrain_gpt.py` / `megatron-pretrain-gpt`: parse flags, build the rank grid, train."""

import os
import sys

import torch.distributed as dist

from megatron.arguments import parse_args, with_data_parallel_size
from megatron.errors import UserError
from megatron.parallel import build_parallel_grid
from megatron.training import TrainResult, pretrain


def main(argv: list[str] | None = None) -> TrainResult:
    try:
        config = parse_args(argv)
        grid = build_parallel_grid(ep_size=config.training.expert_parallel_size)
        return pretrain(with_data_parallel_size(config, grid.dp_size), grid)
    except UserError as exc:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
