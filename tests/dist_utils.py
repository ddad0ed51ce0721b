"""Run a function in N gloo processes on the CPU and collect each rank's tensors."""

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from megatron.parallel import free_port

RankFn = Callable[..., dict[str, torch.Tensor]]


def _worker(rank: int, world_size: int, port: int, fn: RankFn, args: tuple, out_dir: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size)
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        result = fn(*args)
        save_file({k: v.detach().contiguous() for k, v in result.items()}, f"{out_dir}/rank{rank}.safetensors")
    finally:
        dist.destroy_process_group()


def run_distributed(fn: RankFn, world_size: int, *args) -> list[dict[str, torch.Tensor]]:
    """Call fn(*args) on every rank of a fresh gloo world; return the tensors each rank returned.
    fn must be a module-level function (it is pickled into the spawned processes)."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_worker, args=(world_size, free_port(), fn, args, out_dir), nprocs=world_size, join=True)
        return [load_file(str(Path(out_dir) / f"rank{rank}.safetensors")) for rank in range(world_size)]


Results = list[dict[str, torch.Tensor]]


def _selected_layouts(request: pytest.FixtureRequest, world: int) -> tuple[list[str], bool]:
    """The layouts of `world` ranks that this session's selected tests of the requesting module
    check (their `layout` parameter), and whether a test of that world without one (a checkpoint
    test) is selected too."""
    layouts, others = set(), False
    for item in request.session.items:
        spec = getattr(item, "callspec", None)
        if getattr(item, "module", None) is not request.module or spec is None or spec.params.get("world") != world:
            continue
        if "layout" in spec.params:
            layouts.add(spec.params["layout"])
        else:
            others = True
    return sorted(layouts), others


def layout_spawns(request: pytest.FixtureRequest, fn: RankFn, *args: object) -> Callable[[int], Results]:
    """For a module whose tests each check one layout (parametrized `world` and `layout`) or the
    checkpoints moved between layouts (`world` alone): each world's results from one spawn, made
    when a test first asks, of fn(*args, layouts, checkpoints) with only what the selected tests
    need, so that a layout run alone (`pytest -k`) trains that layout alone."""
    made: dict[int, Results] = {}

    def results(world: int) -> Results:
        if world not in made:
            made[world] = run_distributed(fn, world, *args, *_selected_layouts(request, world))
        return made[world]

    return results
