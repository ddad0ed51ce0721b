"""Checkpoint writes at the disk's speed (issue 32): one rank's checkpoint of a model of --params
parameters (benchmarks/checkpoint.py's stack of square Linear layers after one AdamW step: weights
and both moments, 12 bytes a parameter) written by

- `python`: today's synchronous save (save.py: buffered writes, checksummed, fsync'd, manifest);
- `fast`: the same save through the fast writer (aio_writer.py: O_DIRECT through the aio op, the
  ds_config's `checkpoint.writer.type: fast`);
- `torch.save`: torch.save of the model's and optimizer's state dicts to one file, fsync'd;
- fio: a sequential O_DIRECT write of the same byte count (the best of a small grid, on the first
  round), the disk's limit.

Interleaved rounds (the order reversed every other round), the page cache settled before each write;
medians. Also each save loaded back cold (its pages dropped) by Engine.load_checkpoint against fio's
sequential read, and, for `--async-save`, how long training waits at an asynchronous save (the
checks and the copy into host memory) against the synchronous save's time, at --async-params (the
copy needs that much memory again). Targets: fast >= 0.8x fio and >= 2x torch.save; blocked <= 5% of
the synchronous save; load >= 0.8x fio's read.

Prints a table and writes JSON (default benchmarks/results/checkpoint_write.json).
"""

import argparse
import contextlib
import json
import os
import shutil
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from benchmarks.aio import FioConfig, ensure_fio, fio_gbps, machine
from benchmarks.checkpoint import (
    build_engine,
    checkpoint_files,
    default_folder,
    drop_cached,
    parse_count,
    settle_page_cache,
    timed,
)
from megatron.checkpoint.aio_writer import AioWriter
from megatron.checkpoint.async_save import AsyncCheckpointSaver
from megatron.checkpoint.save import save_folder
from megatron.runtime.config.schema import AioConfig
from megatron.runtime.engine import Engine

FIO_GRID = [FioConfig(1 << 20, 16, 1, False), FioConfig(4 << 20, 8, 1, False), FioConfig(1 << 20, 16, 2, False)]


def folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in checkpoint_files(folder))


def torch_save(engine: Engine, folder: Path) -> None:
    folder.mkdir()
    path = folder / "checkpoint.pt"
    torch.save({"model": engine.module.state_dict(), "optimizer": engine.optimizer.state_dict()}, path)
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def timed_save(save: Any, folder: Path) -> float:
    shutil.rmtree(folder, ignore_errors=True)
    settle_page_cache()
    return timed(lambda: save(folder))


def timed_load(engine: Engine, folder: Path) -> float:
    drop_cached(folder)
    return timed(lambda: engine.load_checkpoint(str(folder.parent), folder.name))


def measure_writes(engine: Engine, work: Path, rounds: int, writer: AioWriter) -> dict[str, Any]:
    state = engine.checkpoint_state()
    saves = {
        "python": lambda folder: save_folder(replace(state, opener=None), folder, None),
        "fast": lambda folder: save_folder(replace(state, opener=writer.open), folder, None),
        "torch.save": lambda folder: torch_save(engine, folder),
    }
    seconds: dict[str, list[float]] = {name: [] for name in [*saves, "load python", "load fast"]}
    size = 0
    for round_ in range(rounds):
        for name in saves if round_ % 2 == 0 else reversed(list(saves)):
            seconds[name].append(timed_save(saves[name], work / name))
            if name in ("python", "fast"):
                size = folder_bytes(work / name)
                seconds[f"load {name}"].append(timed_load(engine, work / name))
            shutil.rmtree(work / name)  # three of them would not fit every disk
            print(f"  round {round_ + 1}: {name} {seconds[name][-1]:.2f} s", flush=True)
    return {"bytes": size, "seconds": seconds}


def measure_fio(work: Path, size: int, rounds: int) -> dict[str, Any]:
    ensure_fio()
    size -= size % (16 << 20)  # whole 4 MiB blocks for each of up to 4 jobs: O_DIRECT needs aligned offsets
    path = work / "fio.bin"
    with open(path, "wb") as handle:  # fio reads what is there: a file of the checkpoint's size
        handle.truncate(size)
    best = max(FIO_GRID, key=lambda config: fio_gbps(path, config, read=False, size=size))
    writes = [fio_gbps(path, best, read=False, size=size) for _ in range(rounds)]
    reads = []
    for _ in range(rounds):
        drop_cached(work)
        reads.append(fio_gbps(path, best, read=True, size=size))
    path.unlink()
    return {"config": best.label(), "bytes": size, "write_gbps": writes, "read_gbps": reads}


def measure_async(params: int, work: Path, rounds: int, step_rows: int) -> dict[str, Any]:
    """A synchronous save against an async one, copied before training goes on (`blocked_s`) and
    copied by the writer while the next step's forward and backward of `step_rows` rows run
    (`overlapped_blocked_s`: the start plus the update's wait for the copy)."""
    engine, hidden = build_engine(params)
    saver = AsyncCheckpointSaver(engine.parallel, lambda line: None)
    batch = torch.randn(step_rows, hidden)

    def step(before_update: Any = None) -> None:
        engine.backward(engine(batch).square().mean())
        if before_update is not None:
            before_update()
        engine.step()

    keys = ("sync_s", "blocked_s", "overlapped_blocked_s", "step_s", "step_during_copy_s")
    times: dict[str, list[float]] = {key: [] for key in keys}
    for _ in range(rounds):
        times["sync_s"].append(
            timed_save(lambda folder: save_folder(engine.checkpoint_state(), folder, None), work / "sync")
        )
        for overlap in (False, True):
            shutil.rmtree(work / "async", ignore_errors=True)
            settle_page_cache()
            began = time.perf_counter()
            saver.start(engine.checkpoint_state(), str(work / "async"), 1, None, overlap=overlap)
            started = time.perf_counter() - began
            if overlap:
                waited: list[float] = []
                mark = time.perf_counter()
                step(lambda waited=waited: waited.append(timed(saver.wait_for_copy)))
                times["step_during_copy_s"].append(time.perf_counter() - mark)
                times["overlapped_blocked_s"].append(started + waited[0])
            else:
                times["blocked_s"].append(started)
            assert saver.wait() is not None
        mark = time.perf_counter()
        step()
        times["step_s"].append(time.perf_counter() - mark)
    saver.close()
    return {"params": params, "step_rows": step_rows, **times}


def print_table(record: dict[str, Any]) -> None:
    writes, fio = record["writes"], record["fio"]
    gb = writes["bytes"] / 1e9
    median = {name: statistics.median(values) for name, values in writes["seconds"].items()}
    fio_write, fio_read = statistics.median(fio["write_gbps"]), statistics.median(fio["read_gbps"])
    print(f"checkpoint of {record['params']:,} parameters: {gb:.2f} GB; fio's best: {fio['config']}")
    print("| what | seconds | GB/s | against fio | target |")
    print("| --- | ---: | ---: | ---: | --- |")
    for name, target in (("python", ""), ("fast", ">= 0.8x fio, >= 2x torch.save"), ("torch.save", "")):
        rate = gb / median[name]
        print(f"| save {name} | {median[name]:.2f} | {rate:.2f} | {rate / fio_write:.2f} | {target} |")
    print(f"| fio write | {gb / fio_write:.2f} | {fio_write:.2f} | 1.00 | |")
    for name in ("python", "fast"):
        rate = gb / median[f"load {name}"]
        print(
            f"| load (saved by {name}), cold | {median[f'load {name}']:.2f} | {rate:.2f} | {rate / fio_read:.2f} | >= 0.8x |"
        )
    print(f"| fio read, cold | {gb / fio_read:.2f} | {fio_read:.2f} | 1.00 | |")
    print(f"fast / torch.save: {median['torch.save'] / median['fast']:.2f}x")
    print_async(record["async"])


def print_async(a: dict[str, Any]) -> None:
    median = {key: statistics.median(values) for key, values in a.items() if isinstance(values, list)}
    sync = median["sync_s"]
    print(f"--async-save at {a['params']:,} parameters, against a {sync:.2f} s synchronous save (target <= 5%):")
    blocked = median["blocked_s"]
    print(f"  copied before training goes on: training waits {blocked:.2f} s ({100 * blocked / sync:.1f}%)")
    print(
        f"  copied during the next step ({a['step_rows']} rows, {median['step_s']:.2f} s alone, "
        f"{median['step_during_copy_s']:.2f} s beside the copy): training waits {median['overlapped_blocked_s']:.2f} s "
        f"({100 * median['overlapped_blocked_s'] / sync:.1f}%)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=parse_count, default=1_000_000_000)
    parser.add_argument("--async-params", type=parse_count, default=500_000_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--folder", type=Path, default=None, help="on the disk to measure (default: a fresh one)")
    parser.add_argument("--step-rows", type=int, default=256, help="rows of the step that runs beside the copy")
    parser.add_argument("--async-only", action="store_true", help="only the --async-save measurement")
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/checkpoint_write.json"))
    args = parser.parse_args()
    if args.async_only:
        work = args.folder or default_folder()
        try:
            record = {"async": measure_async(args.async_params, work, args.rounds, args.step_rows)}
        finally:
            shutil.rmtree(work, ignore_errors=True)
        save(record, args.output.with_name(args.output.stem + "_async.json"))
        print_async(record["async"])
        return
    work = args.folder or default_folder()
    work.mkdir(parents=True, exist_ok=True)
    try:
        engine, _ = build_engine(args.params)
        aio = AioConfig()
        writer = AioWriter(aio.handle_settings(), 64 << 20, True, print)
        record: dict[str, Any] = {"params": args.params, "machine": machine(work), "aio": aio.handle_settings()}
        record["writes"] = measure_writes(engine, work, args.rounds, writer)
        save(record, args.output)  # each phase as it ends: a later one's failure keeps the earlier numbers
        record["fio"] = measure_fio(work, record["writes"]["bytes"], args.rounds)
        save(record, args.output)
        del engine, writer
        record["async"] = measure_async(args.async_params, work, args.rounds, args.step_rows)
        with contextlib.suppress(OSError):
            record["load_average"] = os.getloadavg()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    save(record, args.output)
    print_table(record)


def save(record: dict[str, Any], output: Path) -> None:
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
