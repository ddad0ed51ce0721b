"""ZeRO stage-3 parameter offload to NVMe: full training steps of a model of about 200M parameters
(the offload benchmark's LinearStack, fp32, one process) through megatron.runtime.initialize, with
the optimizer's moments in NVMe swap files (offload_optimizer "nvme", pipelined: the best setting
benchmarks/offload.py found) in every variant, and the fp32 master of the parameters

  params in memory              no offload_param: on one process stage 3 keeps the parameters
                                whole, and they are the master
  params nvme                   offload_param "nvme", max_in_cpu 0: the whole master in swap files;
                                every parameter is freed between uses and gathered module by module
                                (read from its file through one of buffer_count 5 buffers), read
                                ahead in the order recorded in the first step
  params nvme, no read-ahead    the same with stage3_prefetch_bucket_size 0: each gather reads its
                                file when the module needs it
  params nvme, 2 buffers        the same as "params nvme" with buffer_count 2

What is measured: the forward+backward and the engine.step of each timed step; the process's peak
RSS (VmHWM) while building (the model is built whole, with values, before initialize, because
ZeRO-3's partition copies the values at construction) and during the timed steps, and its RSS after
the warm-up and after the timed steps, the latter also after malloc_trim(0) (glibc may keep freed
memory that it would hand back); the bytes of the fp32 master held in host memory, of the
gradients, of the swap buffers (optimizer ring + parameter swapper) and of the swap files; and the
bytes the process read from and wrote to the disk per step (/proc/self/io: the aio op's O_DIRECT
transfers are counted there).

Reference: per step, "params nvme" reads every parameter's 4 bytes twice (gathered for forward and
again for backward), and its optimizer reads and writes the master (4 bytes) and the moments (8
bytes) of every parameter: 20 bytes read and 12 written per parameter. The disk is measured once per
round (benchmarks/offload.py's measure_disk: a write pass over an existing file, then a cold read);
io_s = read bytes / read GB/s + written bytes / write GB/s. Ratios: "params nvme" step / max(in-
memory step, io_s), "params nvme" / "params in memory", and "no read-ahead" / "params nvme".

Rounds: in each round every variant is built afresh in its own process (same seed, so its peak RSS
is its own), takes one untimed warm-up step (records the gather order; with fast_init writes every
moment file once), then --steps timed steps. The order rotates every round. Times are medians over
rounds of each round's median; ratios are medians of per-round ratios. Every variant runs the same
arithmetic on the same data, so the losses must agree exactly.

Prints a table and writes JSON (default benchmarks/results/param_offload.json).
"""

import argparse
import ctypes
import datetime
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from benchmarks import offload
from benchmarks.aio import default_folder, fs_type, machine
from benchmarks.moe_layer import proc_status_bytes
from benchmarks.offload import (
    AIO,
    HYPER,
    LinearStack,
    measure_disk,
    meminfo_bytes,
    short,
    time_optimizer,
    train_step,
    warm_up_vml,
)
from benchmarks.zero import tensor_bytes
from megatron.ops.io_bench import check_folder, drop_page_cache
from megatron.parallel import single_process_grid
from megatron.runtime import initialize
from megatron.runtime.swap.slots import ALIGN, align_up
from megatron.runtime.zero.param_partition import ParamPartition

REPO = Path(__file__).resolve().parent.parent
GiB, MiB = 2**30, 2**20
READ_BYTES_PER_PARAM = 4 + 4 + 4 + 8  # forward gather, backward gather, optimizer: master and moments
WRITE_BYTES_PER_PARAM = 4 + 8  # optimizer: master and moments


@dataclass(frozen=True)
class Variant:
    name: str
    offload_params: bool
    prefetch: bool = True
    param_buffers: int = 5  # offload_param.buffer_count (its default)


VARIANTS = {
    "memory": Variant("params in memory", False),
    "nvme": Variant("params nvme", True),
    "no-prefetch": Variant("params nvme, no read-ahead", True, prefetch=False),
    "2-buffers": Variant("params nvme, 2 buffers", True, param_buffers=2),
}


def runtime_config(variant: Variant, folder: Path, hidden: int, sub_group_size: int) -> dict[str, Any]:
    """benchmarks/offload.py's pipelined NVMe optimizer config, moved to stage 3."""
    optimizer = offload.Variant("optimizer nvme", "nvme", sub_group_size, buffer_count=3, pipelined=True)
    config = offload.runtime_config(optimizer, folder)
    zero = config["zero_optimization"]
    zero.update(stage=3, stage3_param_persistence_threshold=0)  # every layer is gathered and freed
    if not variant.prefetch:
        zero["stage3_prefetch_bucket_size"] = 0
    if variant.offload_params:
        # a chunk's read window can start one 4 KiB block early: one layer plus a block
        zero["offload_param"] = {
            "device": "nvme",
            "nvme_path": str(folder),
            "max_in_cpu": 0,
            "buffer_count": variant.param_buffers,
            "buffer_size": align_up(hidden**2) + ALIGN,
        }
    return config


def build_engine(variant: Variant, layers: int, hidden: int, folder: Path, sub_group_size: int) -> Any:
    """The model gets its values before initialize (the stage-3 partition copies them when it is
    made), the same values as benchmarks/offload.py's model."""
    model = LinearStack(layers, hidden)
    generator = torch.Generator().manual_seed(0)
    bound = math.sqrt(3 / hidden)
    with torch.no_grad():
        for param in model.parameters():
            param.uniform_(-bound, bound, generator=generator)
    config = runtime_config(variant, folder, hidden, sub_group_size)
    return initialize(model, config, single_process_grid(torch.device("cpu")))


def disk_io() -> dict[str, int]:
    """Bytes this process moved to and from the storage layer so far (O_DIRECT included)."""
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return {"read": int(fields["read_bytes"]), "write": int(fields["write_bytes"])}


def reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # VmHWM := VmRSS


def folder_bytes(path: str | None) -> int:
    return sum(f.stat().st_size for f in Path(path).iterdir()) if path else 0


def host_memory(engine: Any) -> dict[str, int]:
    """What the engine holds in host memory: the fp32 master, the gradients, the swap buffers."""
    stores = [p.store for p in engine.strategy.partitions if isinstance(p, ParamPartition)]
    flat = [p for p in engine.strategy.partitions if not isinstance(p, ParamPartition)]
    master = [s.memory for s in stores] + [p.shard.detach() for p in flat]  # flat on one rank: the parameters
    swapper, optimizer = engine.strategy.swapper, engine.optimizer
    param_slots = [slot.buffer for slot in swapper.slots] if swapper else []
    return {
        "master_bytes": tensor_bytes(master),
        "grad_bytes": tensor_bytes([p.shard_grad for p in engine.strategy.partitions]),
        "optimizer_buffer_bytes": tensor_bytes([slot.buffer for slot in optimizer.slots]),
        "param_buffer_bytes": tensor_bytes(param_slots),
        "swap_buffer_bytes": tensor_bytes([slot.buffer for slot in optimizer.slots] + param_slots),
        "optimizer_file_bytes": folder_bytes(optimizer.folder.path),
        "param_file_bytes": folder_bytes(swapper.folder.path if swapper and swapper.folder else None),
        "swapped_numel": swapper.swapped_numel if swapper else 0,
        "resident_numel": swapper.resident_numel if swapper else sum(p.shard.numel() for p in flat),
    }


def run_variant(spec: dict[str, Any]) -> dict[str, Any]:
    """In a fresh process: build, warm up, time spec["steps"] steps; memory read at each stage."""
    warm_up_vml()
    reset_peak_rss()
    base_rss = proc_status_bytes("VmRSS")
    variant = Variant(**spec["variant"])
    engine = build_engine(variant, spec["layers"], spec["hidden"], Path(spec["folder"]), spec["sub_group_size"])
    build_rss, build_peak_rss = proc_status_bytes("VmRSS"), proc_status_bytes("VmHWM")
    optimizer_s = time_optimizer(engine)
    x_BH = torch.randn(1, spec["hidden"], generator=torch.Generator().manual_seed(1))
    warmup_loss = train_step(engine, x_BH)[2]  # records the gather order, writes the moment files once
    warm_rss = proc_status_bytes("VmRSS")
    reset_peak_rss()  # the steady state's own peak from here
    io_before, cached_before = disk_io(), meminfo_bytes("Cached")
    steps = [train_step(engine, x_BH) for _ in range(spec["steps"])]
    io_after = disk_io()
    record = {
        "compute_s": [s[0] for s in steps],
        "engine_step_s": [s[1] for s in steps],
        "step_s": [s[0] + s[1] for s in steps],
        "optimizer_s": optimizer_s[1:],
        "losses": [warmup_loss] + [s[2] for s in steps],
        "read_bytes_per_step": (io_after["read"] - io_before["read"]) / spec["steps"],
        "write_bytes_per_step": (io_after["write"] - io_before["write"]) / spec["steps"],
        "page_cache_growth_bytes": meminfo_bytes("Cached") - cached_before,
        "peak_live_numel": engine.strategy.gatherer.peak_live_numel if engine.strategy.gatherer else 0,
        "base_rss": base_rss,
        "build_rss": build_rss,
        "build_peak_rss": build_peak_rss,
        "warm_rss": warm_rss,
        "steps_peak_rss": proc_status_bytes("VmHWM"),
        "rss": proc_status_bytes("VmRSS"),
        **host_memory(engine),
    }
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # what glibc keeps of freed memory is not the engine's
    record["trimmed_rss"] = proc_status_bytes("VmRSS")
    engine.optimizer.folder.remove()
    if engine.strategy.swapper and engine.strategy.swapper.folder:
        engine.strategy.swapper.folder.remove()
    return record


def run_child(spec: dict[str, Any]) -> dict[str, Any]:
    command = [sys.executable, "-m", "benchmarks.param_offload", "--variant-child", json.dumps(spec)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    if done.returncode:
        raise RuntimeError(f"{spec['variant']['name']} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def describe(name: str, result: dict[str, Any]) -> str:
    """One progress line for a variant's run or the disk's measurement."""
    if name == "disk":
        return f"disk: write {result['write_gbps']:.2f} GB/s, read {result['read_gbps']:.2f} GB/s"
    ms = {k: 1000 * statistics.median(result[f"{k}_s"]) for k in ("step", "compute", "engine_step")}
    return (
        f"{name}: step {ms['step']:.0f} ms (fwd+bwd {ms['compute']:.0f}, engine.step {ms['engine_step']:.0f}), "
        f"RSS {result['rss'] / GiB:.2f} GiB"
    )


def run_rounds(args: argparse.Namespace, todo: list[Variant], folder: Path, flush: bool) -> list[dict[str, Any]]:
    """Every variant and the disk once per round, starting one later in the list each round."""
    disk_bytes = 8 * args.layers * args.hidden**2 // MiB * MiB  # as benchmarks/offload.py: whole MiB
    jobs: dict[str, Callable[[], dict[str, Any]]] = {
        v.name: partial(
            run_child,
            {
                "variant": asdict(v),
                "layers": args.layers,
                "hidden": args.hidden,
                "folder": str(folder),
                "steps": args.steps,
                "sub_group_size": args.sub_group_size,
            },
        )
        for v in todo
    }
    jobs["disk"] = partial(measure_disk, folder, disk_bytes, flush)
    names, rounds = list(jobs), []
    for index in range(args.rounds):
        order = names[index % len(names) :] + names[: index % len(names)]
        record: dict[str, Any] = {"order": order, "load_average": os.getloadavg()[0]}
        for name in order:
            started = time.perf_counter()
            record[name] = jobs[name]()
            print(f"round {index} {describe(name, record[name])} ({time.perf_counter() - started:.0f} s)", flush=True)
        rounds.append(record)
    return rounds


def median_of_medians(rounds: list[dict[str, Any]], name: str, key: str) -> float:
    return statistics.median(statistics.median(r[name][key]) for r in rounds)


def ratio(numerators: list[float], denominators: list[float]) -> dict[str, Any]:
    values = [n / d for n, d in zip(numerators, denominators)]
    return {"median": statistics.median(values), "rounds": values}


def summarise(todo: list[Variant], rounds: list[dict[str, Any]], numel: int) -> dict[str, Any]:
    read, written = READ_BYTES_PER_PARAM * numel, WRITE_BYTES_PER_PARAM * numel
    io_s = [read / 1e9 / r["disk"]["read_gbps"] + written / 1e9 / r["disk"]["write_gbps"] for r in rounds]
    step = {v.name: [statistics.median(r[v.name]["step_s"]) for r in rounds] for v in todo}
    memory, nvme = VARIANTS["memory"].name, VARIANTS["nvme"].name
    ratios: dict[str, Any] = {}
    if memory in step and nvme in step:
        ratios["nvme_over_bound"] = ratio(step[nvme], [max(m, io) for m, io in zip(step[memory], io_s)])
        ratios["nvme_over_memory"] = ratio(step[nvme], step[memory])
    for key in ("no-prefetch", "2-buffers"):
        if nvme in step and VARIANTS[key].name in step:
            ratios[f"{key}_over_nvme"] = ratio(step[VARIANTS[key].name], step[nvme])
    rows = []
    for v in todo:
        runs = [r[v.name] for r in rounds]
        row = {
            **asdict(v),
            **{
                f"{k}_ms": 1000 * median_of_medians(rounds, v.name, f"{k}_s")
                for k in ("step", "compute", "engine_step", "optimizer")
            },
            "step_ms_rounds": [1000 * s for s in step[v.name]],
        }
        for key in (
            "build_peak_rss",
            "steps_peak_rss",
            "warm_rss",
            "rss",
            "trimmed_rss",
            "read_bytes_per_step",
            "write_bytes_per_step",
            "page_cache_growth_bytes",
            "base_rss",
            "build_rss",
        ):
            row[key] = statistics.median(run[key] for run in runs)
        row.update(
            {
                k: runs[0][k]
                for k in (
                    "master_bytes",
                    "grad_bytes",
                    "optimizer_buffer_bytes",
                    "param_buffer_bytes",
                    "swap_buffer_bytes",
                    "optimizer_file_bytes",
                    "param_file_bytes",
                    "swapped_numel",
                    "resident_numel",
                    "peak_live_numel",
                )
            }
        )
        rows.append(row)
    disk = {
        "read_gbps": statistics.median(r["disk"]["read_gbps"] for r in rounds),
        "write_gbps": statistics.median(r["disk"]["write_gbps"] for r in rounds),
        "reference_read_bytes": read,
        "reference_write_bytes": written,
        "io_ms": 1000 * statistics.median(io_s),
        "io_ms_rounds": [1000 * s for s in io_s],
    }
    same = all(len({tuple(r[v.name]["losses"]) for v in todo}) == 1 for r in rounds)
    return {"disk": disk, "rows": rows, "ratios": ratios, "same_losses_in_every_variant": same}


def print_tables(summary: dict[str, Any], numel: int, sub_group_size: int) -> None:
    disk = summary["disk"]
    print(
        f"\n{numel:,} parameters; optimizer: moments on NVMe, pipelined, sub_group_size {short(sub_group_size)}, "
        f"3 buffers; disk write {disk['write_gbps']:.2f} GB/s, cold read {disk['read_gbps']:.2f} GB/s -> "
        f"reference I/O of 'params nvme' ({disk['reference_read_bytes'] / 1e9:.2f} GB read + "
        f"{disk['reference_write_bytes'] / 1e9:.2f} GB written) {disk['io_ms']:.0f} ms; "
        f"losses identical across variants: {summary['same_losses_in_every_variant']}"
    )
    print(
        "\n| variant | step ms | fwd+bwd ms | engine.step ms | read GB/step | written GB/step | master in host MiB "
        "| grads MiB | swap buffers MiB (optimizer + params) | swap files GiB |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in summary["rows"]:
        print(
            f"| {r['name']} | {r['step_ms']:.0f} | {r['compute_ms']:.0f} | {r['engine_step_ms']:.0f} "
            f"| {r['read_bytes_per_step'] / 1e9:.2f} | {r['write_bytes_per_step'] / 1e9:.2f} "
            f"| {r['master_bytes'] / MiB:.0f} | {r['grad_bytes'] / MiB:.0f} "
            f"| {r['swap_buffer_bytes'] / MiB:.0f} ({r['optimizer_buffer_bytes'] / MiB:.0f} + "
            f"{r['param_buffer_bytes'] / MiB:.0f}) | {(r['optimizer_file_bytes'] + r['param_file_bytes']) / GiB:.2f} |"
        )
    # a step's peak above the steady state: what it allocates on top (gathered parameters, gradients)
    print(
        "\n| variant | peak RSS building GiB | RSS after warm-up GiB | peak RSS in steps GiB (above warm-up) "
        "| RSS after steps GiB | after malloc_trim GiB | peak live params (gatherer) MiB |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in summary["rows"]:
        print(
            f"| {r['name']} | {r['build_peak_rss'] / GiB:.2f} | {r['warm_rss'] / GiB:.2f} | {r['steps_peak_rss'] / GiB:.2f} "
            f"({(r['steps_peak_rss'] - r['warm_rss']) / MiB:+.0f} MiB) | {r['rss'] / GiB:.2f} | {r['trimmed_rss'] / GiB:.2f} "
            f"| {4 * r['peak_live_numel'] / MiB:.0f} |"
        )
    labels = {
        "nvme_over_bound": "params nvme / max(params in memory, reference I/O)",
        "nvme_over_memory": "params nvme / params in memory",
        "no-prefetch_over_nvme": "no read-ahead / params nvme",
        "2-buffers_over_nvme": "2 buffers / params nvme",
    }
    print("\n| ratio of step times | median | per round |\n| --- | ---: | --- |")
    for key, value in summary["ratios"].items():
        print(f"| {labels[key]} | {value['median']:.2f} | {', '.join(f'{v:.2f}' for v in value['rounds'])} |")


def swap_folder(requested: Path | None) -> tuple[Path, bool]:
    """The requested folder, or a new one under the temp dir (beside the repository where that is a
    tmpfs, which has no O_DIRECT); whether it was made here."""
    if requested is None:
        temp = Path(tempfile.gettempdir())
        made = (
            default_folder()
            if fs_type(temp) == "tmpfs"
            else Path(tempfile.mkdtemp(prefix="param_offload_bench_", dir=temp))
        )
        return made, True
    requested.mkdir(parents=True, exist_ok=True)
    if fs_type(requested) == "tmpfs":
        print(f"warning: {requested} is on tmpfs: no O_DIRECT, the swap files are memory", file=sys.stderr)
    return requested, False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--folder",
        type=Path,
        help="swap folder (default: a new folder under the temp dir, or "
        "beside the repository when that is a tmpfs; removed at the end)",
    )
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--sub-group-size", type=float, default=5e7, help="the optimizer's sub_group_size")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variant-child", help=argparse.SUPPRESS)
    parser.add_argument("--output", type=Path, default=REPO / "benchmarks/results/param_offload.json")
    args = parser.parse_args()
    if args.variant_child:
        print(json.dumps(run_variant(json.loads(args.variant_child))))
        return
    args.sub_group_size = int(args.sub_group_size)
    todo = [VARIANTS[key] for key in args.variants]
    numel = args.layers * args.hidden**2
    folder, made_folder = swap_folder(args.folder)
    check_folder(folder, 4 * 2 * numel + 8 * numel + GiB)  # master and moments, the disk test's file, slack
    info, flush = machine(folder), drop_page_cache()
    print(
        f"{numel:,} parameters ({args.layers} x {args.hidden}^2), {torch.get_num_threads()} threads; swap folder "
        f"{folder} on {info['device']} ({info['filesystem']}); aio {AIO.describe()}; cold disk reads: {flush}",
        flush=True,
    )
    started = time.perf_counter()
    try:
        rounds = run_rounds(args, todo, folder, flush)
    finally:
        if made_folder:
            shutil.rmtree(folder, ignore_errors=True)
    summary = summarise(todo, rounds, numel)
    print_tables(summary, numel, args.sub_group_size)
    report = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": info,
        "threads": torch.get_num_threads(),
        "aio": asdict(AIO),
        "cold_disk_reads": flush,
        "model": {"layers": args.layers, "hidden": args.hidden, "parameters": numel},
        "sub_group_size": args.sub_group_size,
        "hyperparameters": HYPER,
        "steps": args.steps,
        "rounds_count": args.rounds,
        "wall_s": time.perf_counter() - started,
        **summary,
        "rounds": rounds,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
