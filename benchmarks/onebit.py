"""Bytes a rank sends per optimizer step, and step time, with 1-bit Adam after its warm-up against
Adam (its gradient all-reduce), counted at the collectives by the communication log. Issue 31 expects
about 1/32 of fp32 plus the scales.

A tiny-to-small GPT (dense, and MoE with 8 experts every other layer, expert parallelism 1) on 2 and
4 gloo ranks, ZeRO stage 0, through Engine forward/backward/step on random tokens: 3 steps of
warm-up (OneBitAdam's freeze_step is 2, so its third step already compresses), then `--steps`
measured. Bytes are NCCL-tests' message sizes (comms_log.py) of the step's gradient or momentum
traffic: all_reduce for Adam; all_to_all_single plus all_gather_into_tensor for 1-bit Adam, the
loop's small reductions (non-finite flags) included in both; bus bytes weigh each by NCCL-tests'
bus factor (2(n-1)/n for an all-reduce, (n-1)/n for the others): what a rank puts on the wire.
Time is the slower rank's wall time per step, medians of interleaved rounds.

Prints a table and writes JSON (default benchmarks/results/onebit.json).
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.aio import machine
from megatron.comm.comms_log import CommsLog, bus_factor
from megatron.model import GPTConfig, GPTModel
from megatron.parallel import build_parallel_grid
from megatron.runtime import initialize
from tests.dist_utils import run_distributed

SHAPE = dict(num_layers=4, hidden_size=256, num_attention_heads=8, vocab_size=4096, max_position_embeddings=128)
OPTIMIZERS = {
    "Adam": {"type": "Adam", "params": {"lr": 1e-4}},
    "OneBitAdam": {"type": "OneBitAdam", "params": {"lr": 1e-4, "freeze_step": 2}},
}


def rank_run(kind: str, warmup: int, steps: int, rounds: int) -> dict[str, torch.Tensor]:
    grid = build_parallel_grid(torch.device("cpu"))
    experts = (8,) if kind == "moe" else (1,)  # every other layer (expert_interval 2)
    out: dict[str, torch.Tensor] = {}
    engines = {}
    for name, optimizer in OPTIMIZERS.items():
        torch.manual_seed(0)
        model = GPTModel(GPTConfig(**SHAPE, num_experts=experts))
        engines[name] = initialize(model, {"train_batch_size": 4 * grid.world_size, "optimizer": optimizer}, grid)
    tokens = torch.randint(0, SHAPE["vocab_size"], (4, 128), generator=torch.Generator().manual_seed(grid.rank))

    def step(engine) -> None:
        output = engine(tokens, labels_BS=tokens.roll(-1, 1))
        engine.backward(output.losses_BS.mean() + output.router_loss)
        engine.step()

    for engine in engines.values():
        for _ in range(warmup):
            step(engine)
    times = {name: [] for name in engines}
    for round_ in range(rounds):
        for name in engines if round_ % 2 == 0 else reversed(list(engines)):
            engine, log = engines[name], CommsLog(prints=False)
            dist.barrier()
            began = time.perf_counter()
            with log.recording():
                for _ in range(steps):
                    step(engine)
            elapsed = torch.tensor(time.perf_counter() - began)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times[name].append(float(elapsed) / steps)
            out[f"{name}_bytes"] = torch.tensor(sum(t.bytes for t in log.totals()) / steps)
            out[f"{name}_bus_bytes"] = torch.tensor(
                sum(r.message_bytes * r.count * bus_factor(r.op, r.ranks) for r in log.summary()) / steps
            )
    for name, values in times.items():
        out[f"{name}_seconds"] = torch.tensor(values, dtype=torch.float64)
    out["params"] = torch.tensor(sum(p.numel() for p in engines["Adam"].module.parameters()))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--output", default="benchmarks/results/onebit.json")
    args = parser.parse_args()
    rows = []
    print(f"{'model':<6}{'ranks':>6}{'params':>11}{'Adam MB/step':>14}{'1-bit MB/step':>15}{'ratio':>8}"
          f"{'bus ratio':>11}{'Adam ms':>10}{'1-bit ms':>10}{'time ratio':>12}")  # fmt: skip
    for kind in ("dense", "moe"):
        for ranks in (2, 4):
            result = run_distributed(rank_run, ranks, kind, args.warmup, args.steps, args.rounds)[0]
            adam, onebit = float(result["Adam_bytes"]), float(result["OneBitAdam_bytes"])
            adam_bus, onebit_bus = float(result["Adam_bus_bytes"]), float(result["OneBitAdam_bus_bytes"])
            t_adam, t_one = result["Adam_seconds"].tolist(), result["OneBitAdam_seconds"].tolist()
            row = {
                "model": kind,
                "ranks": ranks,
                "params": int(result["params"]),
                "adam_bytes_per_step": adam,
                "onebit_bytes_per_step": onebit,
                "bytes_ratio": onebit / adam,
                "adam_bus_bytes_per_step": adam_bus,
                "onebit_bus_bytes_per_step": onebit_bus,
                "bus_bytes_ratio": onebit_bus / adam_bus,
                "adam_ms": 1000 * statistics.median(t_adam),
                "onebit_ms": 1000 * statistics.median(t_one),
                "time_ratio": statistics.median(o / a for o, a in zip(t_one, t_adam)),
            }
            rows.append(row)
            print(
                f"{kind:<6}{ranks:>6}{row['params']:>11,}{adam / 1e6:>14.3f}{onebit / 1e6:>15.3f}"
                f"{row['bytes_ratio']:>8.4f}{row['bus_bytes_ratio']:>11.4f}{row['adam_ms']:>10.1f}{row['onebit_ms']:>10.1f}"
                f"{row['time_ratio']:>12.3f}"
            )
    result = {"machine": machine(Path(".")), "date": time.strftime("%Y-%m-%d"), "args": vars(args), "rows": rows}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
