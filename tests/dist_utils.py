"""Run a function in N gloo processes on the CPU and collect each rank's tensors.

The ranks are forked from a fork server that imported torch and the toolkit once for the whole
session: a spawned rank spends seconds importing torch (5-7 s for two ranks on a 2-core AMD EPYC),
a forked one a tenth of a second (the server also imports torch._dynamo, which torch's optimizers
import when the first one is made: 2 s in every rank otherwise). The server itself never computes, so no thread pool or
process group is forked. A rank takes the caller's environment, working directory and standard output and
error at the call (the server's are those of the session's start, before pytest captured them)."""

import multiprocessing
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

multiprocessing.set_forkserver_preload(
    ["torch", "torch.distributed", "torch._dynamo", "safetensors.torch", "megatron.training.loop"]
)


def _worker(
    rank: int,
    world_size: int,
    port: int,
    fn: RankFn,
    args: tuple,
    out_dir: str,
    env: dict[str, str],
    cwd: str,
    caller: int,
) -> None:
    for fd in (1, 2):  # the caller's, which pytest may be capturing (capfd)
        target = os.open(f"/proc/{caller}/fd/{fd}", os.O_WRONLY | os.O_APPEND)
        os.dup2(target, fd)
        os.close(target)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
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
        mp.start_processes(
            _worker,
            args=(world_size, free_port(), fn, args, out_dir, dict(os.environ), os.getcwd(), os.getpid()),
            nprocs=world_size,
            join=True,
            start_method="forkserver",
        )
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
