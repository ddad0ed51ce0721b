"""Optimizer offload and NVMe swapping: the optimizer step of a model of about 200M parameters
trained one step at a time through megatron.runtime.initialize (ZeRO stage 1, one process, fp32),
with its Adam state

  memory        in host memory, torch.optim.AdamW(fused=True): no offload
  cpu           offload_optimizer "cpu": CPUAdam (the native kernel), state in host memory
  nvme ...      offload_optimizer "nvme": SwappedAdam, the two moments (8 bytes per parameter) in
                swap files under --folder; not pipelined (buffer_count 1) and pipelined
                (buffer_count 3, pipeline_read and pipeline_write), at sub_group_size 1e9
                (DeepSpeed's default: one sub-group, nothing to overlap) and smaller sizes

next to the time the disk needs to read and write that state once, at the GB/s measured in the
same round by the aio benchmark's measuring code (megatron.ops.io_bench's Workload and measure,
which benchmarks/aio.py runs) with the handle settings the swapping uses. Target: the pipelined
NVMe step takes at most 1.2x max(in-memory step, state I/O time).

The model is a stack of bias-free hidden x hidden linear layers with tanh, fed one row: forward
and backward are cheap, the step is what is measured. It is built on the meta device and only
given memory (and values) once the engine has made its parameters views of ZeRO's flat buffer,
so no second copy of the weights ever exists.

Rounds: in each round every variant is built afresh (same seed), takes one untimed warm-up step
(with fast_init it writes every swap file once, so each timed step reads and writes all the
state), then --steps timed steps; the disk is measured once per round (a write pass over an
existing file, as every step after the first overwrites its files, then a cold read). The order
rotates every round so machine drift hits all alike. Times are medians over rounds of each
round's median; ratios are medians of per-round ratios.

Page cache: the swap files are read and written with O_DIRECT (the aio op), so they bypass the
page cache and the steps are not flattered by it; the cache is dropped (sync + drop_caches, as
benchmarks/aio.py does) only before the disk's read pass. The growth of the page cache across the
timed steps is recorded to check that no swap traffic goes through it.

Then the largest model that trains with 4 GiB of host memory for optimizer state: from the
measured bytes per parameter, and shown by one real training step (two: the first only writes the
fresh swap files) of a model whose Adam state does not fit in 4 GiB, in a fresh process, with the
optimizer-state bytes held in host memory (optimizer.state tensors plus the swap buffers) and the
process's peak RSS.

Prints tables and writes JSON (default benchmarks/results/offload.json).
"""

import argparse
import datetime
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.aio import fs_type, machine
from benchmarks.moe_layer import proc_status_bytes
from benchmarks.zero import tensor_bytes
from megatron.ops.io_bench import AioSettings, Workload, check_folder, drop_page_cache, measure
from megatron.parallel import single_process_grid
from megatron.runtime import initialize
from megatron.runtime.swap.swapped_adam import SwappedAdam

REPO = Path(__file__).resolve().parent.parent
GiB = 2**30
HOST_STATE_BUDGET = 4 * GiB
HYPER = {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}
# the aio benchmark's default handle; the swapping uses the same settings (its "aio" block)
AIO = AioSettings()


@dataclass(frozen=True)
class Variant:
    name: str
    device: str  # offload_optimizer.device: none, cpu, nvme
    sub_group_size: int = 1_000_000_000
    buffer_count: int = 1
    pipelined: bool = False


def short(count: float) -> str:
    """50000000 -> '5e7'."""
    mantissa, exponent = f"{count:.0e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def variants(sub_groups: list[int]) -> list[Variant]:
    out = [Variant("memory", "none"), Variant("cpu", "cpu"), Variant("nvme 1e9", "nvme")]
    out += [Variant(f"nvme {short(s)}", "nvme", s) for s in sub_groups[:1]]
    out += [Variant(f"nvme {short(s)} pipelined", "nvme", s, 3, True) for s in sub_groups]
    return out


class LinearStack(nn.Module):
    def __init__(self, layers: int, hidden: int, device: str | torch.device | None = None) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden, bias=False, device=device) for _ in range(layers))

    def forward(self, x_BH: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x_BH = torch.tanh(layer(x_BH))
        return x_BH.square().mean()


def runtime_config(variant: Variant, folder: Path) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": 1, "sub_group_size": variant.sub_group_size}
    if variant.device != "none":
        offload: dict[str, Any] = {"device": variant.device}
        if variant.device == "nvme":
            offload.update(
                nvme_path=str(folder),
                buffer_count=variant.buffer_count,
                pipeline_read=variant.pipelined,
                pipeline_write=variant.pipelined,
                fast_init=True,
            )
        zero["offload_optimizer"] = offload
    return {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": HYPER},
        "gradient_clipping": 1.0,
        "steps_per_print": 0,
        "zero_optimization": zero,
        "aio": asdict(AIO),
    }


def build_engine(variant: Variant, layers: int, hidden: int, folder: Path) -> Any:
    """The model gets memory only as ZeRO's flat buffer (meta -> empty), then its values."""
    model = LinearStack(layers, hidden, device="meta").to_empty(device="cpu")
    engine = initialize(model, runtime_config(variant, folder), single_process_grid(torch.device("cpu")))
    generator = torch.Generator().manual_seed(0)
    bound = math.sqrt(3 / hidden)  # keeps the activations' variance through the layers
    with torch.no_grad():
        for param in engine.module.parameters():
            param.uniform_(-bound, bound, generator=generator)
    engine.strategy.copy_from_parameters()  # the master takes the values (one rank, fp32: the same memory)
    return engine


def time_optimizer(engine: Any) -> list[float]:
    """Wrap engine.optimizer.step; the returned list gets the seconds of each call."""
    inner, seconds = engine.optimizer.step, []

    def timed_step(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        result = inner(*args, **kwargs)
        seconds.append(time.perf_counter() - start)
        return result

    engine.optimizer.step = timed_step
    return seconds


def train_step(engine: Any, x_BH: torch.Tensor) -> tuple[float, float, float]:
    """One step; (forward+backward s, engine.step s, loss)."""
    start = time.perf_counter()
    loss = engine(x_BH)
    engine.backward(loss)
    middle = time.perf_counter()
    engine.step()
    return middle - start, time.perf_counter() - middle, float(loss.detach())


def meminfo_bytes(field: str) -> int:
    with open("/proc/meminfo") as meminfo:
        return next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith(field + ":"))


def host_state(optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of optimizer state in host memory: optimizer.state's tensors, and the swap buffers."""
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    buffers = [slot.buffer for slot in optimizer.slots] if isinstance(optimizer, SwappedAdam) else []
    swap_files = 0
    if isinstance(optimizer, SwappedAdam):
        swap_files = sum(f.stat().st_size for f in Path(optimizer.folder.path).iterdir())
    return {
        "state_tensor_bytes": tensor_bytes(state),
        "swap_buffer_bytes": tensor_bytes(buffers),
        "host_state_bytes": tensor_bytes(state) + tensor_bytes(buffers),
        "swap_file_bytes": swap_files,
        "sub_groups": sum(len(g) for g in optimizer.sub_groups.values()) if buffers else 0,
    }


def run_variant(variant: Variant, layers: int, hidden: int, folder: Path, steps: int) -> dict[str, Any]:
    """Build, warm up, time `steps` steps; in a fresh process (see variant_child)."""
    engine = build_engine(variant, layers, hidden, folder)
    optimizer = engine.optimizer
    optimizer_s = time_optimizer(engine)
    x_BH = torch.randn(1, hidden, generator=torch.Generator().manual_seed(1))
    train_step(engine, x_BH)  # warm-up: creates the state, writes every swap file once
    cached_before = meminfo_bytes("Cached")
    compute_s, engine_s, losses = [], [], []
    for _ in range(steps):
        fwd_bwd, step, loss = train_step(engine, x_BH)
        compute_s.append(fwd_bwd)
        engine_s.append(step)
        losses.append(loss)
    record = {
        "optimizer_s": optimizer_s[1:],
        "engine_step_s": engine_s,
        "compute_s": compute_s,
        "page_cache_growth_bytes": meminfo_bytes("Cached") - cached_before,
        "losses": losses,
        **host_state(optimizer),
    }
    if isinstance(optimizer, SwappedAdam):
        optimizer.folder.remove()
    return record


def warm_up_vml() -> None:
    """The first multithreaded torch.tanh of a process can compute one thread's chunk with a
    low-accuracy MKL VML kernel (a first-call dispatch race, pytorch/pytorch#188792): one call
    before the model's first forward keeps every variant's losses comparable."""
    torch.tanh(torch.zeros(4096))


def variant_child(spec: dict[str, Any]) -> None:
    """One variant in a fresh process: its memory is its own (an engine is not freed when dropped:
    the gradient hooks of ZeRO's reducer keep the flat buffers alive), and so is its peak RSS."""
    warm_up_vml()
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")
    base_rss = proc_status_bytes("VmRSS")
    record = run_variant(
        Variant(**spec["variant"]), spec["layers"], spec["hidden"], Path(spec["folder"]), spec["steps"]
    )
    print(json.dumps({**record, "base_rss": base_rss, "peak_rss": proc_status_bytes("VmHWM")}))


def run_child(flag: str, spec: dict[str, Any]) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.offload", flag, json.dumps(spec)], capture_output=True, text=True, cwd=REPO
    )
    if done.returncode:
        raise RuntimeError(f"{flag} {spec} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure_disk(folder: Path, nbytes: int, flush: bool) -> dict[str, float]:
    """One write pass over an existing file (after an untimed one that lays it out), one cold read."""
    with Workload(folder, nbytes) as workload:
        workload.prepare(read=False)
        write = measure(workload, AIO, read=False, loops=1, warmup=1)["gbps"]
        read = measure(workload, AIO, read=True, loops=1, warmup=0, flush_cache=flush)["gbps"]
    return {"write_gbps": write, "read_gbps": read}


def run_rounds(args: argparse.Namespace, todo: list[Variant], folder: Path, flush: bool) -> tuple[list[dict], int]:
    numel = args.layers * args.hidden**2
    disk_bytes = 8 * numel // 2**20 * 2**20  # the moments, in whole MiB
    rounds = []
    for round_index in range(args.rounds):
        names = [v.name for v in todo] + ["disk"]
        shift = round_index % len(names)
        record: dict[str, Any] = {"order": names[shift:] + names[:shift], "load_average": os.getloadavg()[0]}
        for name in record["order"]:
            started = time.perf_counter()
            if name == "disk":
                record["disk"] = measure_disk(folder, disk_bytes, flush)
                record["disk"]["io_s"] = (
                    disk_bytes / 1e9 / record["disk"]["read_gbps"] + disk_bytes / 1e9 / record["disk"]["write_gbps"]
                )
                print(
                    f"round {round_index} disk: write {record['disk']['write_gbps']:.2f} GB/s, read "
                    f"{record['disk']['read_gbps']:.2f} GB/s",
                    flush=True,
                )
                continue
            variant = next(v for v in todo if v.name == name)
            spec = {
                "variant": asdict(variant),
                "layers": args.layers,
                "hidden": args.hidden,
                "folder": str(folder),
                "steps": args.steps,
            }
            record[name] = run_child("--variant-child", spec)
            print(
                f"round {round_index} {name}: optimizer step "
                f"{1000 * statistics.median(record[name]['optimizer_s']):.0f} ms "
                f"({time.perf_counter() - started:.0f} s with build)",
                flush=True,
            )
        rounds.append(record)
    return rounds, disk_bytes


def summarise(todo: list[Variant], rounds: list[dict], numel: int, disk_bytes: int) -> dict[str, Any]:
    state_bytes = 8 * numel
    # the disk's time for the model's whole state, from each round's GB/s
    io_s = [state_bytes / 1e9 / r["disk"]["read_gbps"] + state_bytes / 1e9 / r["disk"]["write_gbps"] for r in rounds]
    step = {v.name: [statistics.median(r[v.name]["optimizer_s"]) for r in rounds] for v in todo}
    bound = [max(m, io) for m, io in zip(step["memory"], io_s)]
    disk = {
        "read_gbps": statistics.median(r["disk"]["read_gbps"] for r in rounds),
        "write_gbps": statistics.median(r["disk"]["write_gbps"] for r in rounds),
        "measured_bytes": disk_bytes,
        "state_bytes": state_bytes,
        "io_ms": 1000 * statistics.median(io_s),
        "io_ms_rounds": [1000 * s for s in io_s],
    }
    rows = []
    for v in todo:
        first = rounds[0][v.name]
        ratios = [s / b for s, b in zip(step[v.name], bound)]
        row = {
            **asdict(v),
            "optimizer_ms": 1000 * statistics.median(step[v.name]),
            "optimizer_ms_rounds": [1000 * s for s in step[v.name]],
            "engine_step_ms": 1000 * statistics.median(statistics.median(r[v.name]["engine_step_s"]) for r in rounds),
            "compute_ms": 1000 * statistics.median(statistics.median(r[v.name]["compute_s"]) for r in rounds),
            "over_memory": statistics.median(s / m for s, m in zip(step[v.name], step["memory"])),
            "over_io": statistics.median(s / io for s, io in zip(step[v.name], io_s)),
            "over_bound": statistics.median(ratios),
            "over_bound_range": [min(ratios), max(ratios)],
            "page_cache_growth_bytes": max(r[v.name]["page_cache_growth_bytes"] for r in rounds),
            "peak_rss": statistics.median(r[v.name]["peak_rss"] for r in rounds),
            **{
                k: first[k]
                for k in (
                    "state_tensor_bytes",
                    "swap_buffer_bytes",
                    "host_state_bytes",
                    "swap_file_bytes",
                    "sub_groups",
                )
            },
        }
        row["target_met"] = row["over_bound"] <= 1.2 if v.pipelined else None
        rows.append(row)
    # every variant runs the same Adam arithmetic on the same data: the losses must agree exactly
    same = all(len({tuple(r[v.name]["losses"]) for v in todo}) == 1 for r in rounds)
    return {"disk": disk, "rows": rows, "same_losses_in_every_variant": same}


def print_table(summary: dict[str, Any], numel: int) -> None:
    disk, mib = summary["disk"], 2**20
    print(
        f"\n{numel:,} parameters; state 8 B/param = {disk['state_bytes'] / 1e9:.2f} GB; disk write "
        f"{disk['write_gbps']:.2f} GB/s, cold read {disk['read_gbps']:.2f} GB/s -> state I/O (read + write) "
        f"{disk['io_ms']:.0f} ms; losses identical across variants: {summary['same_losses_in_every_variant']}"
    )
    print(
        "\n| variant | sub_group_size | sub-groups | buffers | optimizer step ms | engine.step ms | fwd+bwd ms "
        "| host state MiB | peak RSS GiB | / memory | / I/O | / max(memory, I/O) (range) | target <= 1.2 |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for r in summary["rows"]:
        nvme = r["device"] == "nvme"
        low, high = r["over_bound_range"]
        verdict = "" if r["target_met"] is None else ("met" if r["target_met"] else "MISSED")
        sub_group = short(r["sub_group_size"]) if nvme else "-"
        print(
            f"| {r['name']} | {sub_group} | {r['sub_groups'] if nvme else '-'} "
            f"| {r['buffer_count'] if nvme else '-'} | {r['optimizer_ms']:.0f} | {r['engine_step_ms']:.0f} "
            f"| {r['compute_ms']:.0f} | {r['host_state_bytes'] / mib:.0f} | {r['peak_rss'] / GiB:.2f} | {r['over_memory']:.2f} "
            f"| {r['over_io']:.2f} | {r['over_bound']:.2f} ({low:.2f}-{high:.2f}) | {verdict} |"
        )


def largest_child(spec: dict[str, Any]) -> None:
    """In a fresh process: two training steps of a big model with pipelined NVMe swapping; prints JSON."""
    warm_up_vml()
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")
    base_rss = proc_status_bytes("VmRSS")
    variant = Variant("largest", "nvme", spec["sub_group_size"], 3, True)
    engine = build_engine(variant, spec["layers"], spec["hidden"], Path(spec["folder"]))
    build_rss, build_peak_rss = proc_status_bytes("VmRSS"), proc_status_bytes("VmHWM")
    with open("/proc/self/clear_refs", "w") as clear_refs:  # the steps' own peak from here
        clear_refs.write("5")
    x_BH = torch.randn(1, spec["hidden"], generator=torch.Generator().manual_seed(1))
    optimizer_s = time_optimizer(engine)
    steps = [train_step(engine, x_BH) for _ in range(2)]
    params = list(engine.module.parameters())
    result = {
        "numel": sum(p.numel() for p in params),
        "param_bytes": tensor_bytes(params),
        "grad_bytes": tensor_bytes([p.grad for p in params if p.grad is not None]),
        "optimizer_s": optimizer_s,
        "compute_s": [s[0] for s in steps],
        "engine_step_s": [s[1] for s in steps],
        "losses": [s[2] for s in steps],
        **host_state(engine.optimizer),
        "base_rss": base_rss,
        "build_rss": build_rss,
        "build_peak_rss": build_peak_rss,
        "rss": proc_status_bytes("VmRSS"),
        "step_peak_rss": proc_status_bytes("VmHWM"),
        "peak_rss": max(build_peak_rss, proc_status_bytes("VmHWM")),
    }
    engine.optimizer.folder.remove()
    print(json.dumps(result))


def largest_model(args: argparse.Namespace, folder: Path, summary: dict[str, Any], numel: int) -> dict[str, Any]:
    rows = {r["name"]: r for r in summary["rows"]}
    per_param = {name: rows[name]["host_state_bytes"] / numel for name in ("memory", "cpu")}
    disk_per_param = max(r["swap_file_bytes"] for r in summary["rows"]) / numel
    free = shutil.disk_usage(folder).free
    pipelined = [r for r in summary["rows"] if r["pipelined"]]
    buffers = {r["name"]: r["swap_buffer_bytes"] for r in pipelined}
    limits = {
        "memory_max_params": int(HOST_STATE_BUDGET / per_param["memory"]),
        "cpu_max_params": int(HOST_STATE_BUDGET / per_param["cpu"]),
        "host_state_bytes_per_param": per_param,
        "disk_bytes_per_param": disk_per_param,
        "disk_free_bytes": free,
        # nvme: host state is the buffers only (buffer_count x 2 x sub-group x 4 B), whatever the model size
        "nvme_buffer_bytes": buffers,
        "nvme_max_sub_group_3_buffers": HOST_STATE_BUDGET // (3 * 2 * 4),
        "nvme_max_params_by_disk": int(free / disk_per_param),
    }
    layers = args.largest_layers
    need = 8 * layers * args.hidden**2 + 3 * 2 * 4 * args.largest_sub_group + GiB  # params + grads, buffers, slack
    available = meminfo_bytes("MemAvailable")
    while layers > 1 and (need > available - 8 * GiB or need > args.largest_rss_cap):
        layers -= 1  # keep room for the other engineers' jobs on this machine
        need = 8 * layers * args.hidden**2 + 3 * 2 * 4 * args.largest_sub_group + GiB
    spec = {"layers": layers, "hidden": args.hidden, "sub_group_size": args.largest_sub_group, "folder": str(folder)}
    print(
        f"\nlargest model: {layers} x {args.hidden}^2 = {layers * args.hidden**2:,} parameters, NVMe pipelined, "
        f"sub_group_size {short(args.largest_sub_group)}, 3 buffers (about {need / GiB:.1f} GiB expected)",
        flush=True,
    )
    started = time.perf_counter()
    try:
        run = run_child("--largest-child", spec)
    except RuntimeError as error:
        print(f"the largest-model run failed: {error}", file=sys.stderr)
        return {"limits": limits, "spec": spec, "error": str(error)}
    run["wall_s"] = time.perf_counter() - started
    run["in_memory_state_bytes"] = round(per_param["memory"] * run["numel"])
    run["fits_budget"] = run["host_state_bytes"] <= HOST_STATE_BUDGET
    run["in_memory_fits_budget"] = run["in_memory_state_bytes"] <= HOST_STATE_BUDGET
    return {"limits": limits, "spec": spec, "run": run}


def print_largest(largest: dict[str, Any]) -> None:
    limits = largest["limits"]
    print(f"\nhost memory for optimizer state: {HOST_STATE_BUDGET / GiB:.0f} GiB")
    print(
        f"  in memory (fused AdamW): {limits['host_state_bytes_per_param']['memory']:.4f} B/param measured -> "
        f"at most {limits['memory_max_params'] / 1e6:,.0f}M parameters"
    )
    print(
        f"  CPU offload (CPUAdam):   {limits['host_state_bytes_per_param']['cpu']:.4f} B/param measured -> "
        f"at most {limits['cpu_max_params'] / 1e6:,.0f}M parameters"
    )
    print(
        "  NVMe: host state = swap buffers only ("
        + ", ".join(f"{n}: {b / 2**20:.0f} MiB" for n, b in limits["nvme_buffer_bytes"].items())
        + "), "
        f"not growing with the model; {limits['disk_bytes_per_param']:.4f} B/param on disk, "
        f"{limits['disk_free_bytes'] / 1e9:.0f} GB free -> the disk holds the state of "
        f"{limits['nvme_max_params_by_disk'] / 1e9:.1f}B parameters; the host's limit is then the parameters "
        "and gradients themselves (fp32, one rank: 8 B/param, not optimizer state)"
    )
    if "run" not in largest:
        print("  demonstration failed: see the error above")
        return
    run, mib = largest["run"], 2**20
    print(
        f"  demonstrated: {run['numel']:,} parameters (in memory the state would be "
        f"{run['in_memory_state_bytes'] / GiB:.2f} GiB), {run['sub_groups']} sub-groups"
    )
    print(
        f"    optimizer state in host memory {run['host_state_bytes'] / mib:.0f} MiB (state tensors "
        f"{run['state_tensor_bytes'] / mib:.3f} MiB + swap buffers {run['swap_buffer_bytes'] / mib:.0f} MiB) "
        f"-> {'within' if run['fits_budget'] else 'OVER'} 4 GiB; swap files {run['swap_file_bytes'] / GiB:.2f} GiB"
    )
    print(
        f"    params {run['param_bytes'] / GiB:.2f} GiB, grads {run['grad_bytes'] / GiB:.2f} GiB; RSS at start "
        f"{run['base_rss'] / GiB:.2f} GiB, peak while building the engine {run['build_peak_rss'] / GiB:.2f} GiB, "
        f"after {run['build_rss'] / GiB:.2f} GiB, peak during the two steps {run['step_peak_rss'] / GiB:.2f} GiB"
    )
    print(
        f"    optimizer steps {', '.join(f'{1000 * s:.0f}' for s in run['optimizer_s'])} ms (the first only writes), "
        f"losses {', '.join(f'{loss:.6f}' for loss in run['losses'])}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--folder",
        type=Path,
        help="swap folder (default: a new folder beside the repository, on its disk, removed at the end)",
    )
    parser.add_argument("--layers", type=int, default=12, help="linear layers of the timed model")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument(
        "--sub-groups",
        type=float,
        nargs="+",
        default=[5e7, 2e7],
        help="sub_group_size of the NVMe variants besides 1e9 (the first also runs unpipelined)",
    )
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--largest-layers", type=int, default=40, help="layers of the model beyond 4 GiB of state")
    parser.add_argument("--largest-sub-group", type=float, default=2e7)
    parser.add_argument("--largest-rss-cap", type=float, default=8.5 * GiB, help="bytes the big run may expect to use")
    parser.add_argument("--skip-largest", action="store_true")
    parser.add_argument("--largest-child", help=argparse.SUPPRESS)
    parser.add_argument("--variant-child", help=argparse.SUPPRESS)
    parser.add_argument("--output", type=Path, default=REPO / "benchmarks/results/offload.json")
    args = parser.parse_args()
    if args.largest_child:
        largest_child(json.loads(args.largest_child))
        return
    if args.variant_child:
        variant_child(json.loads(args.variant_child))
        return
    args.largest_sub_group = int(args.largest_sub_group)
    todo = variants([int(s) for s in args.sub_groups])
    numel = args.layers * args.hidden**2
    made_folder = args.folder is None
    folder = Path(os.path.realpath(REPO.parent)) / f"offload_bench_{os.getpid()}" if made_folder else args.folder
    folder.mkdir(parents=True, exist_ok=True)
    if fs_type(folder) == "tmpfs":
        print(f"warning: {folder} is on tmpfs: no O_DIRECT, the swap files are memory", file=sys.stderr)
    check_folder(folder, 8 * max(numel, args.largest_layers * args.hidden**2) + GiB)
    info = machine(folder)
    flush = drop_page_cache()
    print(
        f"{numel:,} parameters ({args.layers} x {args.hidden}^2), {torch.get_num_threads()} threads, swap folder "
        f"{folder} ({fs_type(folder)}); aio {AIO.describe()}; disk reads "
        f"{'cold (page cache dropped before each)' if flush else 'warm (cannot drop the page cache)'}",
        flush=True,
    )
    started = time.perf_counter()
    try:
        rounds, disk_bytes = run_rounds(args, todo, folder, flush)
        summary = summarise(todo, rounds, numel, disk_bytes)
        print_table(summary, numel)
        largest = None if args.skip_largest else largest_model(args, folder, summary, numel)
        if largest is not None:
            print_largest(largest)
    finally:
        if made_folder:
            shutil.rmtree(folder, ignore_errors=True)
    report = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": info,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "aio": asdict(AIO),
        "cold_disk_reads": flush,
        "model": {"layers": args.layers, "hidden": args.hidden, "parameters": numel},
        "hyperparameters": HYPER,
        "steps": args.steps,
        "rounds_count": args.rounds,
        "wall_s": time.perf_counter() - started,
        **summary,
        "largest": largest,
        "rounds": rounds,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
