"""Step time of our CPUAdam (megatron.runtime.optim, the native csrc/adam kernel) against
torch.optim.AdamW(foreach=True) and torch.optim.AdamW(fused=True), on the same fp32 parameters
and gradients (each optimizer keeps its own state), at several model sizes.

The tensors are a GPT-like mix: an embedding of about a tenth of the elements, then blocks of
QKV, projection and two MLP weights with their biases and two layer norms, until the size is
reached. The three optimizers alternate in rounds (the order reversed every other round) so
machine drift hits them alike; per round each takes `--steps` steps and keeps its median. The
reported speed-up (torch time / our time, above 1 means ours is faster) is the median of the
per-round ratios; a second table compares the fastest single step of each. Threads: torch's
intra-op count for all three. The 1-minute load average is recorded each round: on a shared machine
other processes' load changes the picture (see docs/benchmarks.md).

Prints a table and writes JSON (default benchmarks/results/cpu_adam.json).
"""

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.moe_layer import cpu_name
from megatron.runtime.optim import CPUAdam

SIZES = {"10M": 10_000_000, "50M": 50_000_000, "200M": 200_000_000}
HIDDEN = {"10M": 512, "50M": 768, "200M": 1024}
HYPER = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
OPTIMIZERS: dict[str, Callable[[list[torch.Tensor]], torch.optim.Optimizer]] = {
    "ours": lambda params: CPUAdam(params, **HYPER),
    "foreach": lambda params: torch.optim.AdamW(params, foreach=True, **HYPER),
    "fused": lambda params: torch.optim.AdamW(params, fused=True, **HYPER),
}


def gpt_like_shapes(total: int, hidden: int) -> list[tuple[int, ...]]:
    """Tensor shapes of an embedding (about total/10 elements) and transformer blocks up to `total`."""
    block = [
        (3 * hidden, hidden),
        (3 * hidden,),
        (hidden, hidden),
        (hidden,),
        (4 * hidden, hidden),
        (4 * hidden,),
        (hidden, 4 * hidden),
        (hidden,),
        (hidden,),
        (hidden,),
        (hidden,),
        (hidden,),
    ]
    shapes = [(total // 10 // hidden, hidden)]
    while sum(torch.Size(s).numel() for s in shapes) < total:
        shapes += block
    return shapes


def time_steps(optimizer: torch.optim.Optimizer, steps: int) -> list[float]:
    """Seconds of each of `steps` optimizer steps."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return times


def measure(size: str, steps: int, rounds: int) -> dict:
    generator = torch.Generator().manual_seed(0)
    shapes = gpt_like_shapes(SIZES[size], HIDDEN[size])
    params = [torch.nn.Parameter(0.02 * torch.randn(shape, generator=generator)) for shape in shapes]
    for param in params:
        param.grad = 1e-3 * torch.randn(param.shape, generator=generator)
    optimizers = {name: build(params) for name, build in OPTIMIZERS.items()}
    for optimizer in optimizers.values():  # warm-up: creates the state
        optimizer.step()
    per_round, load_average = [], [os.getloadavg()[0]]
    for round_index in range(rounds):
        order = list(optimizers) if round_index % 2 == 0 else list(optimizers)[::-1]
        per_round.append({name: time_steps(optimizers[name], steps) for name in order})
        load_average.append(os.getloadavg()[0])
        medians = {name: statistics.median(times) for name, times in per_round[-1].items()}
        print(
            f"{size} round {round_index}: "
            + ", ".join(f"{n} {1000 * medians[n]:.0f} ms" for n in OPTIMIZERS)
            + f" (load average {load_average[-1]:.1f})",
            flush=True,
        )
    row = {
        "size": size,
        "elements": sum(p.numel() for p in params),
        "tensors": len(params),
        "hidden": HIDDEN[size],
        "per_round_s": per_round,
        "load_average": load_average,
    }
    medians = [{name: statistics.median(times) for name, times in r.items()} for r in per_round]
    for name in OPTIMIZERS:
        row[f"{name}_ms"] = 1000 * statistics.median(m[name] for m in medians)
        # the fastest step is the nearest to an idle machine that a shared one shows
        row[f"{name}_best_ms"] = 1000 * min(min(r[name]) for r in per_round)
    for name in ("foreach", "fused"):
        ratios = [m[name] / m["ours"] for m in medians]
        row[f"speedup_vs_{name}"] = statistics.median(ratios)
        row[f"speedup_vs_{name}_range"] = [min(ratios), max(ratios)]
        row[f"best_speedup_vs_{name}"] = row[f"{name}_best_ms"] / row["ours_best_ms"]
    return row


def print_table(rows: list[dict]) -> None:
    print(
        f"\n{'size':>5} {'tensors':>7} {'ours ms':>8} {'foreach ms':>10} {'fused ms':>9} {'vs foreach':>10} "
        f"{'range':>11} {'vs fused':>8} {'range':>11} {'load':>9}   (speed-up = torch ms / ours ms)"
    )
    for r in rows:
        low_f, high_f = r["speedup_vs_foreach_range"]
        low_u, high_u = r["speedup_vs_fused_range"]
        print(
            f"{r['size']:>5} {r['tensors']:7d} {r['ours_ms']:8.1f} {r['foreach_ms']:10.1f} {r['fused_ms']:9.1f} "
            f"{r['speedup_vs_foreach']:9.2f}x {low_f:5.2f}-{high_f:<5.2f} {r['speedup_vs_fused']:7.2f}x "
            f"{low_u:5.2f}-{high_u:<5.2f} {min(r['load_average']):4.1f}-{max(r['load_average']):<4.1f}"
        )
    print(
        f"\n{'size':>5} {'ours best':>9} {'foreach best':>12} {'fused best':>10} {'vs foreach':>10} {'vs fused':>8}"
        "   (fastest single step of each, ms)"
    )
    for r in rows:
        print(
            f"{r['size']:>5} {r['ours_best_ms']:9.1f} {r['foreach_best_ms']:12.1f} {r['fused_best_ms']:10.1f} "
            f"{r['best_speedup_vs_foreach']:9.2f}x {r['best_speedup_vs_fused']:7.2f}x"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES))
    parser.add_argument("--steps", type=int, default=3, help="timed steps per optimizer per round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--threads", type=int, default=torch.get_num_threads(), help="torch.set_num_threads for all three"
    )
    parser.add_argument("--output", default="benchmarks/results/cpu_adam.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{torch.get_num_threads()} threads, torch CPU capability {torch.backends.cpu.get_cpu_capability()}")
    rows = [measure(size, args.steps, args.rounds) for size in args.sizes]
    print_table(rows)
    report = {
        "machine": platform.machine(),
        "cpu": cpu_name(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "date": time.strftime("%Y-%m-%d"),
        "hyperparameters": HYPER,
        "steps": args.steps,
        "rounds": args.rounds,
        "rows": rows,
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
