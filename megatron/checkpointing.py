"""Megatron's checkpoint layout on top of the engine's atomic save:

    DIR/iter_0000010/            model, optimizer, RNG (safetensors) + engine.json
    DIR/latest_checkpointed_iteration.txt   written last, atomically
"""

import os
from pathlib import Path
from typing import Any

from megatron.errors import CheckpointError
from megatron.parallel import ParallelGrid
from megatron.runtime.engine import Engine

LATEST_FILE = "latest_checkpointed_iteration.txt"


def iteration_tag(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def save_checkpoint(engine: Engine, save_dir: str, iteration: int, client_state: dict[str, Any]) -> Path:
    folder = engine.save_checkpoint(save_dir, iteration_tag(iteration), client_state)
    if engine.parallel.is_first_rank:
        latest = Path(save_dir) / LATEST_FILE
        staging = latest.with_suffix(".tmp")
        staging.write_text(f"{iteration}\n")
        os.replace(staging, latest)
    engine.parallel.barrier()
    return folder


def latest_iteration(load_dir: str) -> int | None:
    """The iteration named in DIR/latest_checkpointed_iteration.txt, or None without one."""
    latest = Path(load_dir) / LATEST_FILE
    if not latest.is_file():
        return None
    text = latest.read_text().strip()
    if not text.isdigit():
        raise CheckpointError(f"{latest} should hold an iteration number but holds {text[:40]!r}; fix or delete it")
    return int(text)


def load_checkpoint(
    engine: Engine, load_dir: str, grid: ParallelGrid, load_optim: bool = True, load_rng: bool = True
) -> dict[str, Any] | None:
    """Load the latest checkpoint in `load_dir`; None (start from scratch) when there is none."""
    iteration = latest_iteration(load_dir)
    if iteration is None:
        if grid.is_first_rank:
            print(f" > no {LATEST_FILE} in {load_dir}: starting from random initialisation", flush=True)
        return None
    client = engine.load_checkpoint(load_dir, iteration_tag(iteration), load_optimizer=load_optim, load_rng=load_rng)
    if grid.is_first_rank:
        print(f" > loaded checkpoint {Path(load_dir) / iteration_tag(iteration)} at iteration {iteration}", flush=True)
    return client
